"""`elastic-launch`: run an elastic training job, inside a Slurm allocation or on this machine.

Put it in the sbatch script (use `exec` so the batch step's USR1 reaches it):

    #SBATCH --nodes=4 --gres=gpu:4 --signal=B:USR1@60
    exec elastic-launch --nnodes 2:4 --gpus-per-node 4 --layouts pp4tp2,pp2tp4,pp2tp2 \\
        --db sqlite:///$HOME/elastic.db -- python -m launcher.worker --layers 24 --hidden 512

It hosts the control plane (launcher.control) on the batch node, starts one step of workers
per node, then carries out every trigger -- `elastic resize`/`elastic preempt`/dashboard
requests from the database, USR1, a worker that dies -- as one migration: pick the layout
(launcher.policy), plan it (migrate.plan), post it, let the workers apply it at one agreed step
boundary, let departing workers exit, give their nodes back (`scontrol update`), and record
the rank map and the migration with its phases in the database. A failed migration or node
release leaves the job on its old layout, with the failure recorded.

Growing beyond the nodes the job holds (it was submitted on fewer, or gave some back, and Slurm
never returns released nodes; 22.05 cannot `--dependency=expand` a job with GRES) submits a
companion job (launcher.backends.slurm, through NodeBackend.acquire: same partition, whole nodes with the same
GPUs and tasks per node, named <job>-companion-<n>). Once it runs (within --companion-timeout),
its workers are started as steps of the companion job with the same environment, join this
control plane, and the grow is a normal migration. A shrink that empties it cancels it; one that
never starts is cancelled and the grow is recorded as failed ("companion job N did not start
within T s") while the job trains on.

When the last devices must go (USR1 with --on-signal suspend, a `suspend` request) the workers
write the state once (migrate.checkpoint) into --checkpoint-dir/step-<S> at an agreed step
boundary and exit; the job is recorded as suspended with that checkpoint. `elastic-launch
--resume` (or a pending `resume` request for the suspended job when the launcher starts) loads
it on whatever layout and device count it gets now and goes on at step S+1. With
--checkpoint-every N the workers also keep one complete safety checkpoint, written in the
background; a failure no replica can recover from (DP = 1) restarts the workers on the devices
left from it, recording how many committed steps were lost.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launcher import control as C
from launcher.errors import UsageError
from launcher.backends import AcquireFailed, CannotAcquire, NodeHandle, Reporter, make_backend, shell_line
from launcher.pause import PendingPauses

SIGNAL_ACTIONS = ("shrink", "suspend", "ignore")


# ----------------------------------------------------------------------------------- options
def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's `--nnodes`: N or MIN:MAX."""
    try:
        lo, sep, hi = text.partition(":")
        lo_n, hi_n = int(lo), int(hi if sep else lo)
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: write N or MIN:MAX, e.g. 2:4") from None
    if lo_n < 1 or hi_n < lo_n:
        raise UsageError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return lo_n, hi_n


def parse_layouts(text: str | None):
    from migrate.layout import LayoutError, ParallelConfig

    if not text:
        return []
    try:
        return [ParallelConfig.parse(t) for t in text.split(",") if t.strip()]
    except LayoutError as exc:
        raise UsageError(f"--layouts: {exc}") from None


def model_from_command(argv: Sequence[str]):
    """The ModelSpec when the command is the reference worker (so layouts are checked up front), else None."""
    if "launcher.worker" not in argv:
        return None
    from launcher.worker import build_parser
    from migrate.layout import LayoutError, ModelSpec

    rest = list(argv[list(argv).index("launcher.worker") + 1:])
    args, _unknown = build_parser().parse_known_args(rest)
    try:
        return ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)
    except LayoutError as exc:
        raise UsageError(f"worker model flags: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elastic-launch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run an elastic hybrid-parallel training job: start one worker per GPU with srun (or as local "
                    "processes), move the model state directly between workers when nodes are taken away or given "
                    "back, and record every rank map and migration in the database.",
        epilog="Workers get torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
               "MASTER_PORT) plus ELASTIC_VIRTUAL_RANK and ELASTIC_LAYOUT for every layout epoch.\n\n"
               "Triggers: `elastic resize JOB --nodes N`, `elastic preempt JOB --nodes n3,n4`, dashboard requests, "
               "SIGUSR1 (see --on-signal), a worker that dies.\n\n"
               "Example (in an sbatch script):\n"
               "  exec elastic-launch --nnodes 2:4 --gpus-per-node 4 --layouts pp4tp2,pp2tp4,pp2tp2 \\\n"
               "      --db sqlite:///$HOME/elastic.db -- python -m launcher.worker --layers 24 --hidden 512",
    )
    p.add_argument("--nnodes", default="1", metavar="MIN:MAX",
                   help="nodes to run on, N or MIN:MAX (torchrun's spelling); the job never shrinks below MIN "
                        "(default 1)")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="GPUs (workers) per node (default: $SLURM_GPUS_ON_NODE, else 1)")
    p.add_argument("--layouts", metavar="L1,L2,...",
                   help="allowed layouts in order of preference, e.g. pp4tp2,pp2tp4,pp2tp2; for each device count "
                        "the valid one using most devices wins. Default: any PP x TP x DP grid with TP inside a "
                        "node, layers %% pp == 0 and heads %% tp == 0")
    p.add_argument("--db", metavar="URL", default=None,
                   help="SQLAlchemy URL or SQLite path where rank maps, migrations and requests live "
                        "(default $ELASTIC_DB_URL or sqlite:///var/elastic.db)")
    p.add_argument("--backend", choices=("auto", "slurm", "local"), default="auto",
                   help="slurm: the running allocation ($SLURM_JOB_ID), through pyslurm when a matching one imports, "
                        "else the Slurm commands; local: processes on this machine; auto (default): slurm inside "
                        "a Slurm job, else local")
    p.add_argument("--job-id", type=int, default=None,
                   help="Slurm job to run in (default $SLURM_JOB_ID)")
    p.add_argument("--local-nodes", type=int, default=None, metavar="N",
                   help="local backend: simulated nodes (default MAX of --nnodes)")
    p.add_argument("--job-name", default=None, help="name recorded in the database (default $SLURM_JOB_NAME or 'elastic')")
    p.add_argument("--master-addr", default=None,
                   help="address workers use to reach the control plane (default: this host's name; 127.0.0.1 "
                        "for the local backend)")
    p.add_argument("--master-port", type=int, default=0, help="control-plane port (default: a free port)")
    p.add_argument("--on-signal", choices=SIGNAL_ACTIONS, default="shrink",
                   help="what SIGUSR1 (Slurm's warning, #SBATCH --signal=B:USR1@60) does: shrink to MIN nodes, "
                        "suspend (stop the workers at a step boundary, mark the job suspended), or ignore "
                        "(default shrink)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help="where the job's checkpoints go (suspend, --checkpoint-every) and --resume reads them; "
                        "every node must see it (default: checkpoints/<job name> next to a SQLite --db, else "
                        "./var/checkpoints/<job name>)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="write a safety checkpoint every N steps in the background (training pauses only for "
                        "the in-memory copy); a failure that no DP replica covers restarts from it (default 0: never)")
    p.add_argument("--resume", action="store_true",
                   help="resume the suspended job of --job-name from its checkpoint (the database's, else the "
                        "newest complete one in --checkpoint-dir) on whatever layout fits now, at the next step")
    p.add_argument("--log-dir", type=Path, default=None, help="write worker output under this folder (default: inherit)")
    p.add_argument("--poll", type=float, default=0.2, help="seconds between checks of workers and requests (default 0.2)")
    p.add_argument("--ready-timeout", type=float, default=180.0,
                   help="seconds new workers have to start and register (default 180)")
    p.add_argument("--migrate-timeout", type=float, default=300.0,
                   help="seconds a migration may take before it counts as failed (default 300)")
    p.add_argument("--companion-timeout", type=float, default=120.0,
                   help="Slurm: growing beyond the nodes the job holds submits a companion job (same partition, "
                        "GPUs and tasks per node) whose steps run the new workers; it has this many seconds to "
                        "start (and its workers to register) or it is cancelled and the grow fails (default 120)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the srun and scontrol commands it would run and exit; starts and writes nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the worker program, e.g. `-- python -m launcher.worker --layers 24 --hidden 512`")
    return p


@dataclass
class Options:
    min_nodes: int
    max_nodes: int
    gpus_per_node: int
    layouts: list
    command: list[str]
    db_url: str | None = None
    on_signal: str = "shrink"
    job_name: str = "elastic"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    poll: float = 0.2
    ready_timeout: float = 180.0
    migrate_timeout: float = 300.0
    companion_timeout: float = 120.0
    model: object = None
    trigger_default: str = "resize"
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    resume: bool = False


def options_from_args(args: argparse.Namespace) -> Options:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("give the worker command after `--`, e.g. -- python -m launcher.worker --layers 8")
    lo, hi = parse_nnodes(args.nnodes)
    gpn = args.gpus_per_node
    if gpn is None:
        gpn = int(os.environ.get("SLURM_GPUS_ON_NODE", "1") or 1)
    if gpn < 1:
        raise UsageError(f"--gpus-per-node must be at least 1, got {gpn}")
    layouts = parse_layouts(args.layouts)
    model = model_from_command(command)
    if args.companion_timeout <= 0:
        raise UsageError(f"--companion-timeout must be a positive number of seconds, got {args.companion_timeout}")
    if args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be 0 (off) or a number of steps, got {args.checkpoint_every}")
    from launcher.policy import NoLayoutError, check_node_range

    try:
        check_node_range(lo, hi, gpn, layouts, model)
    except NoLayoutError as exc:
        raise UsageError(f"--layouts/--nnodes: {exc}") from None
    return Options(lo, hi, gpn, layouts, command, db_url=args.db, on_signal=args.on_signal,
                   job_name=args.job_name or os.environ.get("SLURM_JOB_NAME") or "elastic",
                   master_addr=args.master_addr or "127.0.0.1", master_port=args.master_port, poll=args.poll,
                   ready_timeout=args.ready_timeout, migrate_timeout=args.migrate_timeout,
                   companion_timeout=args.companion_timeout, model=model,
                   checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume)


# ----------------------------------------------------------------------------------- launcher
class MigrationFailed(RuntimeError):
    pass


def grow_choice(active: Sequence[str], alloc: Sequence[str], gone: set[str] | frozenset[str],
                want: int) -> tuple[list[str], int]:
    """How to reach `want` nodes: (idle nodes of the allocation to start workers on, how many more
    nodes a companion job must bring). Released nodes (`gone`) never come back to the allocation."""
    idle = [x for x in alloc if x not in set(active) and x not in gone]
    more = max(want - len(active), 0)
    take = idle[:more]
    return take, more - len(take)


@dataclass
class Outcome:
    """What one trigger led to (for logs, requests and the demo's table)."""

    trigger: str
    ok: bool
    message: str
    from_layout: str = ""
    to_layout: str = ""
    phases: dict = field(default_factory=dict)
    bytes_moved: int = 0
    bytes_checkpoint: int = 0
    bit_exact: bool | None = None
    migration_id: int | None = None
    nodes_before: int = 0
    nodes_after: int = 0
    at_step: int | None = None
    pause_s: float | None = None  # set once the new layout committed its first step (launcher.pause)


class Launcher:
    """The control loop: one instance per job, in the batch step (or in `elastic demo`)."""

    def __init__(self, opts: Options, backend, store, *, slurm_job_id: str | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        from migrate.topology import Topology

        self.opts, self.backend, self.db = opts, backend, store
        self.gpn = opts.gpus_per_node
        self.alloc = backend.allocation()
        self.topology = Topology.grid(len(self.alloc), self.gpn, names=self.alloc, pinned=(backend.batch_node,))
        self.index = {n: i for i, n in enumerate(self.alloc)}
        self.slurm_job_id = slurm_job_id
        self.log = log or (lambda m: print(f"[elastic-launch] {m}", file=sys.stderr, flush=True))
        self.reporter = Reporter(self.log, lambda action, text: self.db.audit("elastic-launch", action,
                                                                              f"job:{self.job_id}", text))
        self.ctl: C.Control | None = None
        self.handles: dict[str, NodeHandle] = {}
        self.epoch = -1  # last posted event
        self.current = None  # migrate.RankMap of the running layout
        self.model = None
        self.job_id: int | None = None
        self.signalled = False
        self.outcomes: list[Outcome] = []
        self.stopped = False
        self.suspended = False
        self.world = "w0"  # the process-group world the current layout trains in
        self.pauses = PendingPauses()  # migrations whose pause is known once the new layout commits a step
        self.epoch_base = 0  # database epochs of a resumed job continue after its earlier ones
        self.loss_step = 0  # the last step whose loss is in the database
        self.ckpt_dir = str(Path(opts.checkpoint_dir or default_checkpoint_dir(getattr(store, "url", None),
                                                                               opts.job_name)).resolve())

    # -- helpers ----------------------------------------------------------------------------
    def node_devices(self, node: str) -> list[int]:
        return self.topology.node_devices(node)

    @property
    def active(self) -> list[str]:
        return [n for n in self.alloc if n in self.handles]

    def base_env(self, first_event: int) -> dict[str, str]:
        return {C.ENV_STORE: f"{self.opts.master_addr}:{self.ctl.port}", C.ENV_GPUS_PER_NODE: str(self.gpn),
                C.ENV_FIRST_EVENT: str(first_event), "MASTER_ADDR": self.opts.master_addr,
                "MASTER_PORT": str(self.ctl.port), "PYTHONUNBUFFERED": "1",
                C.ENV_CKPT_DIR: self.ckpt_dir, C.ENV_CKPT_EVERY: str(self.opts.checkpoint_every)}

    def max_step(self) -> int:
        devs = list(self.current.devices) if self.current else []
        return max(self.ctl.steps(devs).values(), default=0)

    def _start_nodes(self, nodes: list[str], first_event: int) -> None:
        for n in nodes:
            for d in self.node_devices(n):  # registrations of earlier workers of this node (a grow after a shrink)
                self.ctl.store.delete_key(f"ready/{d}")
            self.log(f"starting workers on {n}")
            self.handles[n] = self.backend.start(n, self.index[n], self.base_env(first_event), self.opts.command)

    def _wait_ready(self, nodes: list[str], timeout: float | None = None, note: str = "") -> None:
        devs = [d for n in nodes for d in self.node_devices(n)]
        timeout = self.opts.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            ready = self.ctl.ready(devs)
            if len(ready) == len(devs) and self.ctl.model() is not None:
                return
            for n in nodes:
                bad = {d: rc for d, rc in self.handles[n].exited().items() if d not in ready}
                if bad:
                    raise MigrationFailed(f"workers on {n}{note} exited before registering (exit codes {bad}); "
                                          "see their output")
            if time.monotonic() > deadline:
                raise MigrationFailed(f"workers {sorted(set(devs) - set(ready))}{note} did not register within "
                                      f"{timeout:.0f} s")
            time.sleep(0.1)

    def _entries(self, rank_map) -> list[dict]:
        out = []
        for r, d in enumerate(rank_map.devices):
            pp, dp, tp = rank_map.layout.coords(r)
            dev = self.topology.devices[d]
            out.append({"virtual_rank": r, "node": dev.node, "gpu": dev.gpu, "pp": pp, "dp": dp, "tp": tp})
        return out

    def choose(self, devices: int):
        from launcher.policy import choose_layout

        return choose_layout(devices, self.gpn, self.opts.layouts, self.model)

    def launch_spec(self) -> dict:
        """What the dashboard's dry run of a preempt needs without importing the launcher: the model,
        the node range, and the layout this job's policy picks for every node count in it."""
        from migrate.layout import LayoutError

        layouts = {}
        for n in range(self.opts.min_nodes, self.opts.max_nodes + 1):
            try:
                layouts[str(n * self.gpn)] = str(self.choose(n * self.gpn))
            except LayoutError:
                continue
        return {"model": self.ctl.model(), "min_nodes": self.opts.min_nodes, "max_nodes": self.opts.max_nodes,
                "gpus_per_node": self.gpn, "layouts": layouts}

    def record_loss(self) -> None:
        """Copy the latest step the workers reported (loss, layout) into the database, once per step."""
        rep = self.ctl.loss()
        if rep and rep["step"] != self.loss_step:  # a restore from a checkpoint goes back
            self.loss_step = rep["step"]
            self.db.record_step(self.job_id, rep["step"], rep["loss"], rep["layout"])

    # -- start ------------------------------------------------------------------------------
    def start(self) -> None:
        from migrate.layout import ModelSpec
        from migrate.topology import RankMap

        self.ctl = C.Control("0.0.0.0" if self.opts.master_addr not in ("127.0.0.1", "localhost") else "127.0.0.1",
                             self.opts.master_port, server=True)
        self.log(f"control plane on {self.opts.master_addr}:{self.ctl.port}; {self.backend.describe()}")
        nodes = self.alloc[:self.opts.max_nodes]
        self._start_nodes(nodes, 0)
        self._wait_ready(nodes)
        self.model = ModelSpec(**{k: v for k, v in self.ctl.model().items()})
        layout = self.choose(len(nodes) * self.gpn)
        devices = tuple(d for n in nodes for d in self.node_devices(n))[:layout.world_size]
        self.current = RankMap(layout, devices)
        self.epoch = 0
        job, path, requests = self.resume_point()
        ev = {"epoch": 0, "kind": "start", "layout": str(layout), "devices": list(devices)}
        if path:
            ev["checkpoint"] = path
        self.ctl.post(ev)
        if job is None:
            self.job_id = self.db.create_job(self.opts.job_name, str(layout), self.gpn,
                                             self.opts.max_nodes * self.gpn, slurm_job_id=self.slurm_job_id,
                                             pinned_node=self.backend.batch_node, nodes=nodes)
        else:  # the same job goes on: its history, requests and epochs continue
            self.job_id = job.id
            self._adopt(job, nodes)
        self.db.set_launch_spec(self.job_id, self.launch_spec())
        self.db.record_rank_map(self.job_id, self.epoch_base, str(layout), self._entries(self.current))
        self.log(f"job {self.job_id}: {layout} on {len(devices)} devices of {','.join(nodes)}")
        if path:
            try:
                res = self._wait_results(0, list(devices))
                bad = [r.get("error") for r in res.values() if not r.get("ok")]
                if bad:
                    raise MigrationFailed(bad[0])
            except MigrationFailed as exc:
                for r in requests:
                    self.db.complete_request(r.id, "failed", f"resume failed: {exc}")
                self.db.set_job_state(self.job_id, "failed")
                raise MigrationFailed(f"resume from {path} failed: {exc}") from None
            step = min(r["step"] for r in res.values())
            msg = f"resumed from {path} at step {step} on {layout} ({len(devices)} devices)"
            for r in requests:
                self.db.complete_request(r.id, "done", msg)
            self.db.audit("elastic-launch", "resume", f"job:{self.job_id}", msg)
            self.log(msg)

    def resume_point(self):
        """(job to continue or None, checkpoint to start from or None, `resume` requests it answers)."""
        job = self.db.find_job(self.opts.job_name)
        requests = [r for r in self.db.pending_requests(job.id) if r.action == "resume"] \
            if job is not None and job.state == "suspended" else []
        if not self.opts.resume and not requests:
            return None, None, []
        path = None
        if job is not None and job.state == "suspended" and job.checkpoint_path \
                and (Path(job.checkpoint_path) / ".metadata").exists():
            path = job.checkpoint_path
        else:
            found = C.latest_checkpoint(self.ckpt_dir)
            path = found[0] if found else None
        if path is None:
            raise MigrationFailed(f"nothing to resume: job {self.opts.job_name!r} has no checkpoint in the "
                                  f"database and {self.ckpt_dir} holds no complete one")
        if job is not None and job.state != "suspended":
            job = None  # a finished or running job of that name: the resumed run is a new job
        self.log(f"resuming job {self.opts.job_name} from {path}")
        return job, path, requests

    def _adopt(self, job, nodes: list[str]) -> None:
        """Take over a suspended job's row: new allocation, epochs after its last rank map."""
        last = self.db.current_rank_map(job.id)
        self.epoch_base = last.epoch + 1 if last else 0
        self.db.update_job(job.id, slurm_job_id=self.slurm_job_id, pinned_node=self.backend.batch_node,
                           max_devices=max(job.max_devices, self.opts.max_nodes * self.gpn))
        for n in self.db.list_nodes(job.id):
            if n.name not in nodes and n.state in ("active", "idle"):
                self.db.set_node_state(job.id, n.name, "released", pinned=False)
        for n in nodes:
            self.db.set_node_state(job.id, n, "active", pinned=n == self.backend.batch_node)
        self.db.set_job_state(job.id, "running")

    # -- one migration ------------------------------------------------------------------------
    def migrate_to(self, target: list[str], trigger: str, failed: Sequence[int] = (),
                   ready_timeout: float | None = None, note: str = "") -> Outcome:
        """Move the job onto the nodes `target` (pinned node included) with the next layout."""
        from migrate.instructions import LostStateError
        from migrate.layout import LayoutError
        from migrate.plan import plan
        from migrate.topology import Topology

        target = [n for n in self.alloc if n in set(target)]
        before = self.active
        out = Outcome(trigger, False, "", from_layout=str(self.current.layout), nodes_before=len(before),
                      nodes_after=len(before))
        new_nodes = [n for n in target if n not in self.handles]
        leaving = [n for n in before if n not in target]
        e = self.epoch + 1
        try:
            layout = self.choose(sum(len(self.node_devices(n)) for n in target)
                                 - len([d for d in failed if self.topology.devices[d].node in target]))
            topo = Topology(self.topology.devices, frozenset(target))
            t0 = time.perf_counter()
            p = plan(self.model, self.current, layout, topo, frozenset(failed))
            plan_s = time.perf_counter() - t0
            stray = sorted({self.topology.devices[d].node for d in p.curr.devices} - set(target))
            if stray:
                raise LayoutError(f"the planner placed ranks on {stray}, outside the target nodes {target}")
        except (LayoutError, LostStateError) as exc:
            out.message = f"no plan: {exc}"
            self._record_failed(out, trigger, str(layout) if "layout" in locals() else "?", {}, out.message)
            return out
        out.to_layout = str(p.curr.layout)
        out.bytes_moved, out.bytes_checkpoint = p.bytes_moved, p.bytes_checkpoint
        frag = self.db.fragmentation(self.job_id)
        mid = self.db.start_migration(self.job_id, out.from_layout, out.to_layout, trigger, p.summary(), frag)
        out.migration_id = mid
        phases = {"plan": plan_s}
        try:
            if new_nodes:
                self._start_nodes(new_nodes, e)
                self._wait_ready(new_nodes, ready_timeout, note)
            participants = sorted((set(p.prev.devices) - set(p.failed)) | set(p.curr.devices))
            exit_ok = sorted(d for n in leaving for d in self.node_devices(n))
            exit_fail = sorted(d for n in new_nodes for d in self.node_devices(n))
            urgent = bool(failed)
            self.epoch = e
            self.ctl.post({"epoch": e, "kind": "migrate", "plan": p.to_dict(), "participants": participants,
                           "exit_ok": exit_ok, "exit_fail": exit_fail, "urgent": urgent})
            self.log(f"event {e}: {out.from_layout} -> {out.to_layout} on {','.join(target)} ({trigger})")
            results = self._wait_results(e, participants)
            out.at_step = self.ctl.at(e)
            if urgent:
                steps = {r["step"] for r in results.values() if r.get("ok") and r.get("step") is not None}
                out.at_step = min(steps) if steps else None
        except MigrationFailed as exc:
            for n in new_nodes:
                if n in self.handles:
                    self.handles.pop(n).kill()
            out.message = str(exc)
            self.db.finish_migration(mid, "failed", p.bytes_moved, p.bytes_checkpoint, None, phases, error=out.message)
            self.outcomes.append(out)
            self._resume_old(failed)
            return out
        bad = {d: r["error"] for d, r in results.items() if not r["ok"]}
        for name in ("build_groups", "execute", "rebuild", "other"):
            phases[name] = max((r["phases"].get(name, 0.0) for r in results.values()), default=0.0)
        out.phases = phases
        if bad:
            out.message = "migration aborted, old layout kept: " + next(iter(bad.values()))
            self.db.finish_migration(mid, "failed", p.bytes_moved, p.bytes_checkpoint, False, phases, error=out.message)
            for n in new_nodes:
                self.handles.pop(n).kill()
            self.outcomes.append(out)
            self._resume_old(failed)
            return out
        # committed: the new layout trains; the departing workers exit, then their nodes go back
        self.current = p.curr
        self.pauses.add(mid, self.world, f"w{e}", out)
        self.world = f"w{e}"
        self.db.record_rank_map(self.job_id, self.epoch_base + e, out.to_layout, self._entries(p.curr))
        for n in leaving:
            self._reap(n)
        error = None
        notes = []
        if leaving:
            gone = self.gone
            keep = [n for n in self.alloc if n not in leaving and n not in gone]
            try:
                notes = self.backend.release(keep)
                for n in leaving:
                    self.db.set_node_state(self.job_id, n, "released")
            except Exception as exc:  # SlurmError: the job keeps running, the nodes stay allocated
                error = f"node release failed (nodes stay allocated, idle): {exc}"
                for n in leaving:
                    self.db.set_node_state(self.job_id, n, "idle")
        out.bit_exact = all(r.get("units_verified", 0) > 0 for r in results.values() if r.get("step") is not None)
        self.db.finish_migration(mid, "succeeded", p.bytes_moved, p.bytes_checkpoint, out.bit_exact, phases,
                                 error=error, fragmentation_after=self.db.fragmentation(self.job_id))
        out.ok = error is None
        out.nodes_after = len(self.active)
        out.message = error or f"{out.from_layout} -> {out.to_layout}, {len(before)} -> {out.nodes_after} nodes"
        for note in notes:
            out.message += "; " + note
            self.db.audit("elastic-launch", "release", f"job:{self.job_id}", f"{note}: its nodes were given back")
        self.log(out.message + f" (at step {out.at_step}, phases " +
                 ", ".join(f"{k} {v:.3f}s" for k, v in phases.items()) + ")")
        self.outcomes.append(out)
        return out

    def _record_failed(self, out: Outcome, trigger: str, to_layout: str, summary: dict, error: str) -> None:
        mid = self.db.start_migration(self.job_id, out.from_layout, to_layout, trigger, summary,
                                      self.db.fragmentation(self.job_id))
        self.db.finish_migration(mid, "failed", None, None, None, {}, error=error)
        out.migration_id = mid
        self.log(f"{trigger}: {error}")
        self.outcomes.append(out)

    def _resume_old(self, failed: Sequence[int]) -> None:
        """A migration did not commit: every participant kept its old state. When no worker of the old
        layout died, they train on again in a fresh world (event `resume`); otherwise the dead workers
        are found by the next poll and recovered from (on_failure)."""
        if failed or self._dead():
            return
        self.epoch += 1
        self.world = f"w{self.epoch}"
        self.ctl.post({"epoch": self.epoch, "kind": "resume", "layout": str(self.current.layout),
                       "devices": list(self.current.devices)})
        self.log(f"event {self.epoch}: resume {self.current.layout} on its old devices")

    def _dead(self) -> dict[int, int]:
        return {d: rc for h in self.handles.values() for d, rc in h.exited().items() if rc != 0}

    def _wait_results(self, e: int, participants: list[int]) -> dict[int, dict]:
        deadline = time.monotonic() + self.opts.migrate_timeout
        while True:
            res = self.ctl.results(e, participants)
            if len(res) == len(participants):
                return res
            dead = {d: rc for h in self.handles.values() for d, rc in h.exited().items()
                    if d in participants and d not in res}
            if dead:  # a worker that reported, then exited, between the two reads is not dead
                dead = {d: rc for d, rc in dead.items() if not self.ctl.results(e, [d])}
            late = time.monotonic() > deadline
            if dead or late:
                # veto the commit; if every participant had voted yes already, the new layout stands
                if self.ctl.veto(f"ev/{e}/commit"):
                    self.ctl.abort_world(f"w{e}")  # survivors stop waiting for the dead to join it
                    alive = [d for d in participants if d not in dead]
                    while len(self.ctl.results(e, alive)) < len(alive) and time.monotonic() < deadline + 60:
                        time.sleep(0.05)
                    self.log(f"workers {sorted(dead)} died after the migration committed; new layout kept")
                    return self.ctl.results(e, alive)
            if dead:
                raise MigrationFailed(f"workers {sorted(dead)} exited during the migration (exit codes "
                                      f"{sorted(set(dead.values()))}); old layout kept")
            if late:
                raise MigrationFailed(f"no result from devices {sorted(set(participants) - set(res))} within "
                                      f"{self.opts.migrate_timeout:.0f} s")
            time.sleep(0.05)

    def _reap(self, node: str, timeout: float = 60.0) -> None:
        h = self.handles.pop(node, None)
        if h is not None and not self.backend.stop(h, timeout):
            self.log(f"workers on {node} did not exit within {timeout:.0f} s; killed them")

    # -- triggers -----------------------------------------------------------------------------
    def shrink_to(self, n: int, trigger: str) -> Outcome:
        n = max(n, self.opts.min_nodes)
        keep = self._keep_order()[:n]
        return self.migrate_to(keep, trigger)

    def _keep_order(self) -> list[str]:
        """Active nodes, the pinned batch node first, then in the backend's order (NodeBackend.keep_rank:
        e.g. a job's own nodes before a companion job's), then those running most ranks."""
        used: dict[str, int] = {}
        for d in self.current.devices:
            node = self.topology.devices[d].node
            used[node] = used.get(node, 0) + 1
        return sorted(self.active, key=lambda n: (n != self.backend.batch_node, self.backend.keep_rank(n),
                                                  -used.get(n, 0), self.index[n]))

    def grow_to(self, n: int, trigger: str) -> Outcome:
        n = min(n, self.opts.max_nodes)
        take, missing = grow_choice(self.active, self.alloc, self.gone, n)
        if not missing:
            return self.migrate_to(self.active + take, trigger)
        got = self._acquire(missing, n, trigger, len(take))
        if isinstance(got, Outcome):
            return got
        extra = list(got.nodes)
        out = self.migrate_to(self.active + take + extra, trigger,
                              ready_timeout=max(got.deadline - time.monotonic(), 30.0), note=f" ({got.label})")
        on_it = {self.topology.devices[d].node for d in self.current.devices} & set(extra)
        if not out.ok and not on_it:  # the grow did not happen: give the acquired nodes back
            for x in extra:
                h = self.handles.pop(x, None)
                if h is not None:
                    h.kill()
            self.backend.abandon(got, f"the grow failed: {out.message}", self.reporter)
            for x in extra:
                self.db.set_node_state(self.job_id, x, "released")
            out.message = f"{out.message} ({got.label} cancelled)"
        return out

    def _acquire(self, count: int, want: int, trigger: str, idle: int):
        """Ask the backend for `count` more nodes (NodeBackend.acquire) and add them to the topology.
        Returns the Acquired nodes, or the failed Outcome (recorded as a failed migration when the
        backend tried and failed)."""
        from migrate.layout import LayoutError
        from migrate.topology import Device, Topology

        exclude = [x for x in self.alloc if x not in self.gone]  # nodes held now: new ones must be others
        try:
            got = self.backend.acquire(count, job_name=self.opts.job_name, exclude=exclude,
                                       timeout=self.opts.companion_timeout, report=self.reporter)
        except CannotAcquire as exc:
            out = Outcome(trigger, False, f"only {idle} idle node(s) left in the allocation; {exc}",
                          from_layout=str(self.current.layout))
            self.outcomes.append(out)
            return out
        except AcquireFailed as exc:
            try:
                to_layout = str(self.choose(want * self.gpn))
            except LayoutError:
                to_layout = "?"
            out = Outcome(trigger, False, str(exc), from_layout=str(self.current.layout),
                          nodes_before=len(self.active), nodes_after=len(self.active))
            self._record_failed(out, trigger, to_layout, {"nodes_requested": count}, out.message)
            return out
        new = [x for x in got.nodes if x not in self.index]
        if new:
            base = len(self.topology.devices)
            devices = tuple(Device(base + i * self.gpn + g, x, g) for i, x in enumerate(new) for g in range(self.gpn))
            self.topology = Topology(self.topology.devices + devices, self.topology.pinned)
            for x in new:
                self.index[x] = len(self.alloc)
                self.alloc.append(x)
        for x in got.nodes:
            self.db.set_node_state(self.job_id, x, "idle")  # held again (a released name may come back)
        return got

    def preempt(self, nodes: list[str], trigger: str) -> Outcome:
        if self.backend.batch_node in nodes:
            out = Outcome(trigger, False, f"{self.backend.batch_node} runs the batch step and cannot be given back",
                          from_layout=str(self.current.layout))
            self.outcomes.append(out)
            return out
        keep = [n for n in self.active if n not in nodes]
        return self.migrate_to(keep, trigger)

    @property
    def gone(self) -> set[str]:
        """Nodes given back (Slurm never returns them to this allocation)."""
        if self.db is None or self.job_id is None:
            return set()
        if self.backend.released_nodes_return:
            return set()
        return {n.name for n in self.db.list_nodes(self.job_id) if n.state in ("released", "failed")}

    def handle_request(self, req) -> None:
        trigger = "preempt" if req.action == "preempt" else "resize"
        if self._from_dashboard(req):
            trigger = "dashboard"
        self.log(f"request {req.id}: {req.action} {req.params} ({trigger})")
        if req.action in ("grow", "shrink"):
            n = int(req.params.get("nodes", 0))
            if n == len(self.active) or not 1 <= n:
                out = Outcome(trigger, False, f"already on {len(self.active)} nodes")
            elif n < self.opts.min_nodes or n > self.opts.max_nodes:
                out = Outcome(trigger, False, f"{n} nodes is outside --nnodes {self.opts.min_nodes}:{self.opts.max_nodes}")
            else:
                out = self.grow_to(n, trigger) if n > len(self.active) else self.shrink_to(n, trigger)
        elif req.action == "preempt":
            if "nodes" in req.params:
                out = self.preempt(list(req.params["nodes"]), trigger)
            else:
                count = int(req.params.get("count", 1))
                out = self.shrink_to(len(self.active) - count, trigger)
        elif req.action == "suspend":
            out = self.suspend(trigger)
        elif req.action == "resume":
            out = Outcome(trigger, False, "the job is running; resume applies to a suspended job")
        else:
            out = Outcome(trigger, False, f"{req.action} is not supported by this launcher version")
        self.db.complete_request(req.id, "done" if out.ok else "failed", out.message)

    def _from_dashboard(self, req) -> bool:
        for row in self.db.audit_log(limit=100, target=f"job:{self.job_id}"):
            if f"request {req.id} queued" in row.result:
                return "via CLI" not in row.result
        return False

    def on_failure(self, dead: dict[int, int]) -> Outcome:
        """Workers died: re-plan from the surviving replicas onto the nodes still whole."""
        self.log(f"workers {sorted(dead)} died (exit codes {sorted(set(dead.values()))})")
        dead_nodes = sorted({self.topology.devices[d].node for d in dead})
        for n in dead_nodes:
            h = self.handles.pop(n, None)
            if h is not None:
                h.kill()
            self.db.set_node_state(self.job_id, n, "failed")
        failed = [d for d in self.current.devices if self.topology.devices[d].node in dead_nodes]
        keep = [n for n in self.active if n not in dead_nodes]
        if not keep:
            out = Outcome("failure", False, "no node left")
            self._record_failed(out, "failure", "?", {}, out.message)
            return out
        if self.opts.checkpoint_every and self._state_lost(failed):
            found = C.latest_checkpoint(self.ckpt_dir)
            if found:
                return self.restore(keep, *found)
            self.log(f"no complete safety checkpoint in {self.ckpt_dir} yet")
        return self.migrate_to(keep, "failure", failed=failed)

    def _state_lost(self, failed: Sequence[int]) -> bool:
        """True when some (pp, tp) slice of the state has no surviving DP replica."""
        lay = self.current.layout
        need = {(pp, tp) for pp, _dp, tp in map(lay.coords, range(lay.world_size))}
        have = {(lay.coords(r)[0], lay.coords(r)[2]) for r, d in enumerate(self.current.devices) if d not in failed}
        return bool(need - have)

    def restore(self, keep: list[str], path: str, step: int) -> Outcome:
        """Restart the workers on the nodes `keep` from the safety checkpoint of `step` (a failure the
        replicas cannot cover). Recorded as a `failure` migration with the committed steps lost."""
        from migrate.layout import LayoutError
        from migrate.topology import RankMap

        lost = max(self.max_step() - step, 0)
        out = Outcome("failure", False, "", from_layout=str(self.current.layout), nodes_before=len(self.active))
        for n in list(self.handles):  # the survivors hold an incomplete state: start over from the checkpoint
            self.handles.pop(n).kill()
        try:
            layout = self.choose(sum(len(self.node_devices(n)) for n in keep))
        except LayoutError as exc:
            out.message = f"no layout for the nodes left: {exc}"
            self._record_failed(out, "failure", "?", {}, out.message)
            return out
        devices = tuple(d for n in keep for d in self.node_devices(n))[:layout.world_size]
        out.to_layout = str(layout)
        mid = self.db.start_migration(self.job_id, out.from_layout, out.to_layout, "failure",
                                      {"restore_from": path, "step": step}, self.db.fragmentation(self.job_id))
        out.migration_id = mid
        e = self.epoch + 1
        t0 = time.perf_counter()
        try:
            for n in keep:
                for d in self.node_devices(n):
                    self.ctl.store.delete_key(f"ready/{d}")  # the old processes' registrations
                    self.ctl.store.set(f"step/{d}", str(step))
            self._start_nodes(keep, e)
            self._wait_ready(keep)
            self.epoch = e
            self.ctl.post({"epoch": e, "kind": "start", "layout": str(layout), "devices": list(devices),
                           "checkpoint": path, "urgent": True})
            res = self._wait_results(e, list(devices))
            bad = [r.get("error") for r in res.values() if not r.get("ok")]
            if bad:
                raise MigrationFailed(bad[0])
        except MigrationFailed as exc:
            out.message = f"restore from checkpoint at step {step} failed: {exc}"
            self.db.finish_migration(mid, "failed", None, None, None, {}, error=out.message, at_step=step)
            self.log(out.message)
            self.outcomes.append(out)
            return out
        self.pauses.add(mid, self.world, f"w{e}", out)
        self.current, self.world = RankMap(layout, devices), f"w{e}"
        self.db.record_rank_map(self.job_id, self.epoch_base + e, out.to_layout, self._entries(self.current))
        out.ok, out.at_step, out.nodes_after = True, step, len(self.active)
        out.phases = {"rebuild": time.perf_counter() - t0}
        out.message = f"restored from checkpoint at step {step}: {lost} steps lost"
        size = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
        self.db.finish_migration(mid, "succeeded", None, size, None, out.phases, error=out.message,
                                 fragmentation_after=self.db.fragmentation(self.job_id), at_step=step,
                                 steps_lost=lost)
        self.log(f"{out.from_layout} -> {out.to_layout}: {out.message}")
        self.outcomes.append(out)
        return out

    # -- the loop -------------------------------------------------------------------------------
    def stop(self, suspend: bool = False) -> None:
        """Stop every worker at one step boundary (suspend=True: write the state first, see suspend)."""
        if suspend:
            self.suspend("signal")
            return
        self.epoch += 1
        self.ctl.post({"epoch": self.epoch, "kind": "stop"})
        for n in list(self.handles):
            self._reap(n, timeout=120)
        self.pauses.settle(self.ctl, self.db, self.log)
        self.stopped = True
        self.db.set_job_state(self.job_id, "finished")

    def suspend(self, trigger: str) -> Outcome:
        """The last devices must go: every training worker writes its part of the state at one agreed step
        boundary into the checkpoint folder, then all exit; the job is recorded as suspended there."""
        self.epoch += 1
        e = self.epoch
        out = Outcome(trigger, False, "", from_layout=str(self.current.layout), nodes_before=len(self.active))
        self.ctl.post({"epoch": e, "kind": "suspend"})
        devices = list(self.current.devices)
        try:
            res = self._wait_results(e, devices)
            bad = [r.get("error") for r in res.values() if not r.get("ok")]
            paths = {r.get("path") for r in res.values()}
            if bad:
                raise MigrationFailed(bad[0])
            if len(paths) != 1 or not (Path(next(iter(paths))) / ".metadata").exists():
                raise MigrationFailed(f"workers reported checkpoint folders {sorted(map(str, paths))}, none complete")
        except MigrationFailed as exc:
            res, out.message = {}, f"suspend failed, job stopped without a checkpoint: {exc}"
        for n in list(self.handles):
            self._reap(n, timeout=120)
        self.stopped = True
        if res:
            path, step = next(iter(paths)), min(r["step"] for r in res.values())
            self.db.set_checkpoint(self.job_id, path, step, state="suspended")
            out.ok, out.at_step = True, step
            out.message = f"suspended at step {step}: checkpoint {path}"
            self.suspended = True
        else:
            self.db.set_job_state(self.job_id, "failed")
        self.db.audit("elastic-launch", "suspend", f"job:{self.job_id}", out.message)
        self.log(out.message)
        self.outcomes.append(out)
        return out

    def poll_once(self) -> bool:
        """One round of checks; False once the job is over."""
        self.pauses.settle(self.ctl, self.db, self.log)
        exited = {d: rc for h in self.handles.values() for d, rc in h.exited().items()}
        layout_devs = set(self.current.devices)
        if exited and any(rc != 0 for rc in exited.values()):
            dead = {d: rc for d, rc in exited.items() if rc != 0}
            self.ctl.abort_world(self.world)  # survivors abandon the step in flight at once
            out = self.on_failure(dead)
            if not out.ok:
                self.log(f"cannot recover: {out.message}; stopping the job")
                for n in list(self.handles):
                    self.handles.pop(n).kill()
                self.stopped = True
                self.db.set_job_state(self.job_id, "failed")
                return False
            return True
        if layout_devs and layout_devs <= set(exited):  # the workers finished on their own (--steps)
            self.log("workers finished")
            self.epoch += 1
            self.ctl.post({"epoch": self.epoch, "kind": "stop"})  # standby workers
            for n in list(self.handles):
                self._reap(n, timeout=30)
            self.db.set_job_state(self.job_id, "finished")
            self.stopped = True
            return False
        if self.signalled:
            self.signalled = False
            if self.opts.on_signal == "shrink":
                if len(self.active) > self.opts.min_nodes:
                    self.shrink_to(self.opts.min_nodes, "signal")
            elif self.opts.on_signal == "suspend":
                self.log("USR1: suspending")
                self.suspend("signal")
                return False
        self.record_loss()
        for req in self.db.pending_requests(self.job_id):
            self.handle_request(req)
            if self.stopped:
                return False
        return True

    def run(self, until: Callable[["Launcher"], bool] | None = None) -> int:
        """Start, then loop until the workers finish, a stop, or `until(self)` says so."""
        old = signal.signal(signal.SIGUSR1, self._on_usr1)
        old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self.start()
            while self.poll_once():
                if until is not None and until(self):
                    self.stop()
                    break
                time.sleep(self.opts.poll)
            return 0 if self.db.get_job(self.job_id).state in ("finished", "suspended") else 1
        finally:
            signal.signal(signal.SIGUSR1, old)
            signal.signal(signal.SIGTERM, old_term)
            for h in self.handles.values():
                h.kill()
            self.backend.close(self.reporter)

    def _on_usr1(self, _sig, _frame) -> None:
        self.log("SIGUSR1 received")
        self.signalled = True

    def _on_term(self, _sig, _frame) -> None:
        raise KeyboardInterrupt


# ----------------------------------------------------------------------------------- entry
def default_checkpoint_dir(db_url: str | None, job_name: str) -> Path:
    """checkpoints/<job> next to a SQLite database file, else ./var/checkpoints/<job>."""
    if db_url and db_url.startswith("sqlite:///") and len(db_url) > len("sqlite:///"):
        return Path(db_url[len("sqlite:///"):]).parent / "checkpoints" / job_name
    return Path("var") / "checkpoints" / job_name


def dry_run(opts: Options, backend, out=None) -> None:
    out = out or sys.stdout
    alloc = backend.allocation()
    nodes = alloc[:opts.max_nodes]
    env = {C.ENV_STORE: f"{opts.master_addr}:PORT", C.ENV_GPUS_PER_NODE: str(opts.gpus_per_node),
           C.ENV_FIRST_EVENT: "0", "MASTER_ADDR": opts.master_addr, "MASTER_PORT": "PORT", "PYTHONUNBUFFERED": "1"}
    print(f"# {backend.describe()}", file=out)
    print(f"# start: workers on {len(nodes)} node(s)", file=out)
    for i, n in enumerate(nodes):
        for cmd in backend.commands_for_start(n, alloc.index(n), env, opts.command):
            print(shell_line(cmd), file=out)
    keep = nodes[:opts.min_nodes]
    if len(keep) < len(nodes):
        print(f"# shrink to --nnodes minimum {opts.min_nodes} (after moving the state off the other nodes)", file=out)
        for cmd in backend.commands_for_release(keep) or [["# (local backend: the workers exit; nothing to run)"]]:
            print(shell_line(cmd) if not cmd[0].startswith("#") else cmd[0], file=out)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        opts = options_from_args(args)
        backend, slurm_job_id = make_backend(args.backend, job_id=args.job_id, gpus_per_node=opts.gpus_per_node,
                                             min_nodes=opts.min_nodes, max_nodes=opts.max_nodes,
                                             local_nodes=args.local_nodes, log_dir=args.log_dir)
        if args.master_addr is None:
            opts.master_addr = backend.default_master_addr()
        if args.dry_run:
            dry_run(opts, backend)
            return 0
        from launcher.commands.history import open_store

        store = open_store(args.db, create=True)
    except UsageError as exc:
        print(f"elastic-launch: error: {exc}", file=sys.stderr)
        return 2
    try:
        return Launcher(opts, backend, store, slurm_job_id=slurm_job_id).run()
    except KeyboardInterrupt:
        print("elastic-launch: interrupted", file=sys.stderr)
        return 130
    except MigrationFailed as exc:
        print(f"elastic-launch: cannot start the job: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
