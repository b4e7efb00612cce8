"""`elastic demo`: an elastic training job on this machine, shrunk and grown while it trains.

Runs the real launcher with the local backend (N simulated nodes of G devices, one worker
process per device, gloo over loopback): train, shrink to one node, train, grow back, train,
stop. Every rank map and migration goes to a SQLite database (`elastic dashboard --db ...`
shows it). For each migration it prints the per-phase timings next to the checkpoint
baseline: the bytes a save + load round trip would move and the measured time of a DCP
checkpoint restart (save, new processes, resharding load) of the same relayout.
"""
from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from db.units import human_bytes
from launcher.errors import UsageError

DEFAULT_DB = "var/elastic-demo.db"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=2, help="devices (worker processes) per node (default 2)")
    p.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128, 2 heads)")
    p.add_argument("--layouts", default="pp2tp2,pp2,tp2",
                   help="allowed layouts, as for elastic-launch (default pp2tp2,pp2,tp2; '' lets the policy pick)")
    p.add_argument("--steps-between", type=int, default=4, help="training steps between changes (default 4)")
    p.add_argument("--db", default=None, help=f"SQLite path or URL for the records (default {DEFAULT_DB})")
    p.add_argument("--log-dir", type=Path, default=None, help="worker output (default: a folder next to the database)")
    p.add_argument("--dashboard", type=int, nargs="?", const=8050, default=None, metavar="PORT",
                   help="serve the dashboard on 127.0.0.1:PORT (default 8050) while the demo runs, with a "
                        "one-off admin login printed here, and pause before each change so you can watch it")
    p.add_argument("--pause", type=float, default=None,
                   help="seconds to wait before each shrink/grow (default 0, or 8 with --dashboard)")
    p.add_argument("--no-baseline", dest="measure_baseline", action="store_false",
                   help="skip timing a DCP checkpoint restart of each relayout (saves ~10 s per migration)")


def _baseline(out, model) -> str:
    """Seconds a DCP save + restart + resharding load of the same relayout takes on this machine."""
    from migrate.baselines import run_baseline
    from migrate.localrun import free_port
    from migrate.layout import ParallelConfig
    from migrate.train import TrainConfig

    with tempfile.TemporaryDirectory() as tmp:
        try:
            res = run_baseline("dcp", model, ParallelConfig.parse(out.from_layout), ParallelConfig.parse(out.to_layout),
                               tc=TrainConfig(), workdir=Path(tmp), port=free_port())
        except Exception as exc:  # a measurement, never a reason to fail the demo
            return f"failed ({type(exc).__name__}: {exc})"
    return f"{res.total_s:.2f} s"


def _serve_dashboard(db_url: str, port: int, say) -> None:
    """The dashboard in a thread, with a fresh secret and a one-off admin, for watching the demo."""
    import secrets
    import threading

    from werkzeug.serving import make_server

    from dashboard.app import create_app
    from db import Store

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no request log in the demo's table
    password = secrets.token_urlsafe(9)
    with Store(db_url) as store:
        store.add_user("demo", password, role="admin", replace=True)
    app = create_app({"DB_URL": db_url, "SECRET_KEY": secrets.token_hex(32)})
    try:
        server = make_server("127.0.0.1", port, app, threaded=True)
    except OSError as exc:
        raise UsageError(f"cannot serve the dashboard on 127.0.0.1:{port} ({exc}); pick another with --dashboard PORT")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    say(f"dashboard: http://127.0.0.1:{port}/  (log in as demo / {password}; the placement updates live)")


def run(args: argparse.Namespace) -> int:
    from launcher.database import open_store
    from launcher.launch import Options, Launcher, parse_layouts
    from launcher.backends.local import LocalNodes
    from launcher.policy.layouts import NoLayoutError, check_node_range
    from migrate.layout import LayoutError, ModelSpec

    if args.nodes < 2:
        raise UsageError("--nodes must be at least 2 (the demo shrinks to one node and grows back)")
    if args.gpus_per_node < 1 or args.steps_between < 1:
        raise UsageError("--gpus-per-node and --steps-between must be at least 1")
    try:
        model = ModelSpec(layers=args.layers, hidden=args.hidden, vocab=1024, seq_len=32)
    except LayoutError as exc:
        raise UsageError(str(exc)) from None
    layouts = parse_layouts(args.layouts)
    try:
        check_node_range(1, args.nodes, args.gpus_per_node, layouts, model)
    except NoLayoutError as exc:
        raise UsageError(str(exc)) from None
    db_path = args.db or DEFAULT_DB
    if "://" not in db_path:
        Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    store = open_store(db_path, create=True)
    log_dir = args.log_dir or Path(store.display_url.split("///")[-1]).parent / "demo-logs" \
        if "sqlite" in store.display_url else Path("var/demo-logs")
    command = ["python", "-m", "launcher.worker", "--layers", str(args.layers), "--hidden", str(args.hidden),
               "--vocab", "1024", "--seq-len", "32", "--log-every", "1"]
    opts = Options(1, args.nodes, args.gpus_per_node, layouts, command, job_name="demo", poll=0.1,
                   ready_timeout=120, migrate_timeout=120, model=model)
    backend = LocalNodes(args.nodes, args.gpus_per_node, log_dir=log_dir)
    k = args.steps_between
    script = ["shrink", "grow", "stop"]  # each k steps after the one before it applied
    since = [0]  # the step the last action applied at
    say = lambda m: print(m, flush=True)  # noqa: E731
    pause = args.pause if args.pause is not None else (8.0 if args.dashboard else 0.0)
    if args.dashboard:
        _serve_dashboard(store.url, args.dashboard, say)
    launcher = Launcher(opts, backend, store, log=lambda m: say(f"  launcher: {m}"))

    def until(la: Launcher) -> bool:
        """One action a call, k steps after the last one applied: the launcher polls (and records the
        steps' losses for the timeline) between them, whatever a migration's length in steps."""
        if not script or la.max_step() < since[0] + k:
            return False
        what = script.pop(0)
        if what == "stop":
            return True
        if pause:
            say(f"  (pausing {pause:.0f} s before the {what}: watch the placement)")
            time.sleep(pause)
        say(f"step {la.max_step()}: {what} ({len(la.active)} -> "
            f"{1 if what == 'shrink' else args.nodes} node(s))")
        out = la.shrink_to(1, "demo") if what == "shrink" else la.grow_to(args.nodes, "demo")
        if not out.ok:
            say(f"  {what} failed: {out.message}")
        since[0] = out.at_step if out.ok and out.at_step is not None else la.max_step()
        return False

    say(f"elastic demo: {args.nodes} simulated nodes x {args.gpus_per_node} devices, model {args.layers} layers "
        f"x {args.hidden} hidden; records in {store.display_url}; worker logs in {log_dir}")
    try:
        rc = launcher.run(until=until)
    finally:
        store.close()
    migs = [o for o in launcher.outcomes if o.migration_id is not None]
    say("")
    say("migration            nodes  at step  plan    groups  execute rebuild other   total   moved      "
        "checkpoint bit-exact" + ("  DCP checkpoint restart" if args.measure_baseline else ""))
    for o in migs:
        ph = o.phases
        total = sum(ph.values())
        line = (f"{o.from_layout + '->' + o.to_layout:<20} {o.nodes_before}->{o.nodes_after:<3} {str(o.at_step):>7}  "
                + "  ".join(f"{ph.get(p, 0):.3f}s" for p in ("plan", "build_groups", "execute", "rebuild", "other"))
                + f"  {total:.3f}s  {human_bytes(o.bytes_moved):<10} {human_bytes(o.bytes_checkpoint):<10} "
                f"{_checked(o)}")
        if args.measure_baseline and o.ok:
            line += "  " + _baseline(o, model)
        say(line)
    say("")
    say("checkpoint = bytes a save + load round trip moves (one replica written, each new rank's share read).")
    say(f"history: elastic history --db {db_path}    dashboard: elastic dashboard --db {db_path}")
    ok = rc == 0 and len(migs) >= 2 and all(o.ok for o in migs)
    return 0 if ok else 1


def _checked(o) -> str:
    """The demo table's bit-exact column: compared and equal, nothing to compare, or what went wrong."""
    if not o.ok:
        return "failed: " + o.message
    return {True: "yes", None: "nothing moved"}.get(o.bit_exact, "NO")
