"""`elastic bench` end to end: every paper scenario resized live and by checkpoint restart, through the
real launcher with the local backend (one worker process per device, gloo over loopback).

Per scenario, one job:
  1. starts on the old layout and trains (steady-state memory is taken over one step);
  2. is resized live to the new layout (`Launcher.grow_to`/`shrink_to`, the path `elastic resize` takes);
     the pause is the wall time from the old layout's last committed step to the new one's first,
     both stamped by the workers' commit votes, as the launcher records it for every migration (launcher.loop.pauses);
  3. is resized back live (not measured), then suspended (stop at a step boundary, DCP save, exit),
     and resumed by a new launcher on the new layout (new processes, resharding load, first step):
     the restart pause runs from the last commit before the suspend to the first after the resume.

What each row says besides the pause: `pause_breakdown` (the critical path of the live pause from
the workers' marks, launcher.loop.timeline; `--explain` prints every worker's row), `restart_breakdown`
(stop+save, exit, start+load, first step), and `step_s_old`/`step_s_new`, one steady step commit to
commit: both pauses contain one step on the new layout, so no pause can be shorter than that step.

Memory: each worker's peak resident set (VmHWM, reset through /proc/<pid>/clear_refs) is sampled
during the live resize and compared with the same worker's steady state over a training step on
the old and on the new layout (the larger of the two: a shrink's receivers hold more afterwards).
"""
from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from launcher.loop import timeline
from migrate.bench import BenchConfig
from migrate.scenarios import PAPER_SCENARIOS

Progress = Callable[[str], None]


class BenchError(RuntimeError):
    """The scenario could not run to the end; its row carries this message."""


# -- memory of worker processes -------------------------------------------------------------
def _hwm(pid: int) -> int | None:
    """Peak resident bytes of `pid` since its last reset, None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def worker_pids(la) -> dict[int, int]:
    """device -> pid of the launcher's live local workers."""
    return {d: p.pid for h in list(la.handles.values()) for d, p in h.procs.items() if p.poll() is None}


class PeakWatch:
    """Per-device peak RSS of the launcher's workers over a window. The kernel keeps each process's peak
    (VmHWM, reset when the window opens), so the reading when it closes is exact; the samples every
    `every` seconds serve workers that start during the window and ones that exit (they keep their
    last sample, taken at most `every` before they went). Not more often: reading /proc of every
    worker every 20 ms slowed the steps it measured by a few per cent (pp4tp2 -> pp4tp4, two runs
    each: steady pp4tp2 step 1.35/1.30 s against 1.23/1.23 s sampling every 0.5 s), and the restart
    it is compared with is not watched."""

    def __init__(self, la, every: float = 0.25) -> None:
        self.la, self.every = la, every
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakWatch":
        for pid in worker_pids(self.la).values():
            _reset_hwm(pid)
        self._thread.start()
        return self

    def _sample(self) -> None:
        for d, pid in worker_pids(self.la).items():
            v = _hwm(pid)
            if v is not None and v > self.peaks.get(d, 0):
                self.peaks[d] = v

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# -- driving the launcher -------------------------------------------------------------------
def _wait(la, cond: Callable[[], bool], deadline: float, what: str) -> None:
    while not cond():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out waiting for {what}")
        if not la.poll_once():
            raise BenchError(f"the job ended while waiting for {what}: "
                             f"{la.outcomes[-1].message if la.outcomes else 'no outcome'}")
        time.sleep(0.05)


def _train(la, steps: int, deadline: float) -> None:
    """Let the job train `steps` more steps."""
    goal = la.max_step() + steps
    _wait(la, lambda: la.max_step() >= goal, deadline, f"step {goal}")


def _first_commit(la, world: str, deadline: float) -> float:
    _wait(la, lambda: la.ctl.commit_times(world)[0] is not None, deadline, f"the first step of {world}")
    return la.ctl.commit_times(world)[0]


def _steady(la, deadline: float) -> tuple[dict[int, int], float]:
    """Per-device peak RSS over one full training step, and that step's time (commit to commit)."""
    _train(la, 1, deadline)  # start at a step boundary
    before = la.ctl.commit_times(la.world)[1]
    with PeakWatch(la) as w:
        _train(la, 1, deadline)
    return w.peaks, la.ctl.commit_times(la.world)[1] - before


def _resize(la, nodes: int):
    out = la.grow_to(nodes, "resize") if nodes > len(la.active) else la.shrink_to(nodes, "resize")
    if not out.ok:
        raise BenchError(f"resize to {nodes} nodes failed: {out.message}")
    return out


def _launcher(cfg: BenchConfig, nodes: int, workdir: Path, job: str, resume: bool, progress: Progress):
    from db import Store
    from launcher.launch import Launcher, Options
    from launcher.backends.local import LocalNodes
    from migrate.layout import ParallelConfig

    model = cfg.model()
    command = ["python", "-m", "launcher.worker", "--layers", str(model.layers), "--hidden", str(model.hidden),
               "--heads", str(model.heads), "--vocab", str(model.vocab), "--seq-len", str(model.seq_len),
               "--global-batch", str(cfg.global_batch), "--log-every", "0"]
    prev, curr = (ParallelConfig.parse(x) for x in PAPER_SCENARIOS[job.removeprefix("bench-")])
    opts = Options(1, nodes, cfg.gpus_per_node, [prev, curr], command, job_name=job, poll=0.05,
                   ready_timeout=600, migrate_timeout=600, model=model, checkpoint_dir=workdir / "ckpt",
                   resume=resume, release_early=cfg.release_early)
    store = Store(f"sqlite:///{workdir / 'bench.db'}")
    # every worker a new interpreter, as srun starts them: the restart pays what it pays on a cluster
    backend = LocalNodes(max(prev.world_size, curr.world_size) // cfg.gpus_per_node, cfg.gpus_per_node,
                         log_dir=workdir / "logs" / job, fork_server=False)
    return Launcher(opts, backend, store, log=lambda m: progress(f"  launcher: {m}"))


def _shutdown(la) -> None:
    if la is None:
        return
    for h in list(la.handles.values()):
        h.kill()
    la.handles.clear()
    la.db.close()


def run_scenario(name: str, cfg: BenchConfig, workdir: Path, ceilings: dict[int, float], restart: bool,
                 progress: Progress, timeout_s: float = 1200.0, explain: bool = False) -> dict:
    """One row of `elastic bench --json`; a failure is reported in the row, never raised."""
    from migrate.layout import ParallelConfig

    prev, curr = (ParallelConfig.parse(x) for x in PAPER_SCENARIOS[name])
    gpn = cfg.gpus_per_node
    n_prev, n_curr = prev.world_size // gpn, curr.world_size // gpn
    row: dict = {"scenario": name, "pause_s": None, "restart_pause_s": None, "speedup": None, "bytes_moved": None,
                 "peak_mem_ratio": None, "execute_gbps": None,
                 "ceiling_gbps": ceilings.get(max(prev.world_size, curr.world_size), 0.0) / 1e9,
                 "bit_exact": None, "phases": None, "pause_breakdown": None, "step_s_old": None, "step_s_new": None,
                 "restart_breakdown": None, "error": None}
    deadline = time.monotonic() + timeout_s
    job = f"bench-{name}"
    workdir = workdir / name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    la = la2 = None
    try:
        progress(f"[{name}] starting {prev} on {n_prev} x {gpn} worker processes ...")
        la = _launcher(cfg, n_prev, workdir, job, False, progress)
        la.start()
        _train(la, 2, deadline)
        steady, row["step_s_old"] = _steady(la, deadline)
        la.opts.max_nodes = max(n_prev, n_curr)
        progress(f"[{name}] live resize {prev} -> {curr} ...")
        old_devices = la.current.devices
        with PeakWatch(la) as watch:
            out = _resize(la, n_curr)
            # the launcher records the pause once the new layout committed its first step (launcher.loop.pauses)
            _wait(la, lambda: out.pause_s is not None, deadline, "the first step on the new layout")
        row["pause_s"] = out.pause_s
        tl = timeline.read(la.ctl, out, old_devices, la.current.devices)
        if tl is not None:
            row["pause_breakdown"] = {k: round(v, 3) for k, v in tl.critical_path().items()}
            if explain:
                progress(f"[{name}] live " + timeline.explain(tl))
        row["bytes_moved"] = out.bytes_moved
        row["bit_exact"] = bool(out.bit_exact)
        row["phases"] = {k: round(v, 4) for k, v in out.phases.items()}
        execute_s = out.phases.get("execute", 0.0)
        row["execute_gbps"] = out.bytes_moved / execute_s / 1e9 if execute_s else None
        _train(la, 1, deadline)
        steady_new, row["step_s_new"] = _steady(la, deadline)
        busiest = max(watch.peaks, key=watch.peaks.get)
        base = max(steady.get(busiest, 0), steady_new.get(busiest, 0))
        row["peak_mem_ratio"] = watch.peaks[busiest] / base if base else None
        row["peak_rss_bytes"] = watch.peaks[busiest]
        progress(f"[{name}] live pause {row['pause_s']:.2f} s")
        if restart:
            progress(f"[{name}] back to {prev}, then suspend (DCP save) and resume on {curr} in new processes ...")
            _resize(la, n_prev)
            _train(la, 1, deadline)
            sus = la.suspend("resize")
            if not sus.ok:
                raise BenchError(f"suspend failed: {sus.message}")
            saved = time.time()
            last = la.ctl.commit_times(la.world)[1]
            _shutdown(la)
            la = None
            exited = time.time()
            la2 = _launcher(cfg, n_curr, workdir, job, True, progress)
            la2.start()  # returns once every new worker has loaded its part of the checkpoint
            loaded = time.time()
            first = _first_commit(la2, la2.world, deadline)
            row["restart_pause_s"] = first - last
            row["restart_breakdown"] = {"stop+save": round(saved - last, 3), "exit": round(exited - saved, 3),
                                        "start+load": round(loaded - exited, 3), "1st step": round(first - loaded, 3)}
            row["speedup"] = row["restart_pause_s"] / row["pause_s"] if row["pause_s"] else None
            la2.stop()
            progress(f"[{name}] restart pause {row['restart_pause_s']:.2f} s")
    except Exception as exc:  # noqa: BLE001 -- one scenario's failure is its row's error, never the run's
        row["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"[{name}] failed: {row['error']}")
    finally:
        _shutdown(la)
        _shutdown(la2)
        shutil.rmtree(workdir / "ckpt", ignore_errors=True)
    return row


def run_bench(names: list[str], cfg: BenchConfig, workdir: Path, restart: bool, progress: Progress,
              explain: bool = False) -> list[dict]:
    """Every scenario of `names`, in order; the loopback ceilings first (before any store thread)."""
    from migrate.bench import loopback_ceiling
    from migrate.layout import ParallelConfig

    sizes = sorted({max(ParallelConfig.parse(x).world_size for x in PAPER_SCENARIOS[n]) for n in names})
    ceilings: dict[int, float] = {}
    for n in sizes:
        progress(f"measuring the loopback ceiling with {n} processes (each sends and receives at once) ...")
        try:
            ceilings[n] = loopback_ceiling(n)
        except Exception as exc:  # noqa: BLE001 -- reported as a zero ceiling, the scenarios still run
            progress(f"  ceiling with {n} processes failed: {exc}")
    return [run_scenario(n, replace(cfg), workdir, ceilings, restart, progress, explain=explain) for n in names]
