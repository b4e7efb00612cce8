"""Restart mode: torchrun's contract for a program that does not use the runtime API.

Every worker gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID). MASTER_PORT is a
rendezvous store that belongs to the script's world -- hosted by the launcher, a fresh one for
every world, as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE=True makes `init_process_group`
connect to it as a client on every rank) -- never the launcher's own control-plane store.

On a resize, a preemption, Slurm's warning signal or a worker failure the launcher stops every
worker (SIGTERM, SIGKILL after --term-timeout), and starts the new world on the new node set; the
script resumes from its own checkpoint. This module holds the pure parts (the environment) and
the script's rendezvous, and RestartMode, which carries each restart out and records it like a migration.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from launcher.loop.rank_errors import first_failure, logged_failure
from launcher.backends.slurm.hostlist import compress_hostlist
from launcher.wire.env import ENV_ERROR_DIR, ENV_RANK_BASE, ENV_SRUN_PREFIX
from launcher.wire.guarded_store import GuardedStoreServer
from launcher.wire.local_peer import same_user
from launcher.loop.outcome import MigrationFailed, Outcome
from launcher.loop.workers import exit_codes
from migrate.layout import ParallelConfig
from migrate.topology import RankMap


def torchrun_env(*, master_addr: str, master_port: int, node_rank: int, node_sizes: Sequence[int],
                 restart_count: int, run_id: str, max_restarts: int, error_dir: str) -> dict[str, str]:
    """The node-level torchrun variables of node `node_rank` of a world whose nodes run `node_sizes`
    workers each (uneven nodes differ); launcher.runtime.torchrun_exec adds the per-process RANK and LOCAL_RANK
    from ELASTIC_RANK_BASE, the rank of the node's first worker (GROUP_RANK x LOCAL_WORLD_SIZE only when
    nodes are alike)."""
    world = sum(node_sizes)
    return {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "GROUP_RANK": str(node_rank),
            "GROUP_WORLD_SIZE": str(len(node_sizes)), "LOCAL_WORLD_SIZE": str(node_sizes[node_rank]),
            "WORLD_SIZE": str(world), ENV_RANK_BASE: str(sum(node_sizes[:node_rank])),
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world), "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "OMP_NUM_THREADS": "1",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ENV_ERROR_DIR: error_dir}


def srun_world_env(nodes: Sequence[str], node_rank: int, node_sizes: Sequence[int]) -> dict[str, str]:
    """The node-level SLURM_* variables `srun --ntasks=N python train.py` gives on the world's nodes
    (N the world size, `nodes` in rank order), carried under ELASTIC_SRUN_ since srun overwrites
    SLURM_* in every task; launcher.runtime.torchrun_exec renames them and adds SLURM_PROCID,
    SLURM_LOCALID and SLURM_GTIDS per task. A script that reads its ranks as an srun-launched one does
    (Lightning's SLURMEnvironment, submitit) sees the world's, not one node's step."""
    world, count = sum(node_sizes), len(node_sizes)
    hostlist = compress_hostlist(list(nodes))
    per_node = tasks_per_node(node_sizes)
    out = {"SLURM_NTASKS": world, "SLURM_NPROCS": world, "SLURM_STEP_NUM_TASKS": world,
           "SLURM_NNODES": count, "SLURM_JOB_NUM_NODES": count, "SLURM_STEP_NUM_NODES": count,
           "SLURM_NODEID": node_rank, "SLURM_NODELIST": hostlist, "SLURM_JOB_NODELIST": hostlist,
           "SLURM_STEP_NODELIST": hostlist, "SLURM_TASKS_PER_NODE": per_node, "SLURM_STEP_TASKS_PER_NODE": per_node,
           "SLURM_JOB_CPUS_PER_NODE": per_node}
    if len(set(node_sizes)) == 1:  # srun sets it only for --ntasks-per-node, which uneven nodes cannot have
        out["SLURM_NTASKS_PER_NODE"] = node_sizes[0]
    return {f"{ENV_SRUN_PREFIX}{k}": str(v) for k, v in out.items()}


def tasks_per_node(sizes: Sequence[int]) -> str:
    """Slurm's form of tasks per node: [2, 2, 1] -> '2(x2),1'."""
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return ",".join(f"{size}(x{n})" if n > 1 else str(size) for size, n in runs)


def worker_command(command) -> list[str]:
    """What a node starts per worker: launcher.runtime.torchrun_exec sets RANK/LOCAL_RANK, then runs `command`."""
    return ["python", "-m", "launcher.runtime.torchrun_exec", "--", *command]


PROGRESS_S = 5.0  # how often the launcher says what a forming world waits for (ScriptRendezvous.progress)


class ScriptRendezvous:
    """The script's own rendezvous: a store hosted here, a new one for each world (restart). The script joins
    it with `env://`, which sends no credential: the store refuses other users' processes on this host
    (launcher.wire.local_peer), and listens only on the address the workers are given."""

    def __init__(self, host: str, log=None) -> None:
        self.host, self.log = host, log
        self.store: GuardedStoreServer | None = None
        self.world_size = 0
        self.opened = self.said = 0.0

    def new_world(self, world_size: int) -> int:
        """Close the previous world's store and open a fresh one; returns its port."""
        self.close()
        self.store = GuardedStoreServer(self.host, 0, None, on_refused=self.log, admit=same_user)
        self.world_size, self.opened = world_size, time.monotonic()
        self.said = self.opened
        return self.store.port

    def formed(self) -> bool:
        """True once the script's process group is up: gloo and NCCL publish one key per rank."""
        return self.store is not None and self.store.key_count() >= self.world_size

    def progress(self) -> str | None:
        """Every PROGRESS_S while the world forms, what it waits for: a world's start can take a minute
        (interpreters, imports, the script's own checkpoint load before its init_process_group), and a
        launcher that says nothing meanwhile looks stuck. None between two lines and once formed."""
        now = time.monotonic()
        if self.store is None or self.formed() or now - self.said < PROGRESS_S:
            return None
        self.said = now
        return (f"waiting for {self.world_size} workers to join the rendezvous (their init_process_group): "
                f"{min(self.store.key_count(), self.world_size)} joined, {now - self.opened:.0f} s")

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store = None


class RestartMode:
    """One restart-mode job's running world (launcher.loop.launcher.Launcher runs it like a live one).

    Each world is every device of the nodes it runs on, recorded as a rank map of layout
    pp1tp1dp<W>; each restart is recorded as a migration of kind `restart` with phases `stop`
    (SIGTERM until every worker ended) and `start` (new processes until the script's rendezvous
    formed), and pause_s = both: what the launcher can see of the time training stood still (the
    script's own checkpoint load and first step come on top).
    """

    def __init__(self, opts, ctl, holdings, workers, recorder, env_for, error_root: Path) -> None:
        self.opts, self.ctl, self.holdings, self.workers, self.recorder = opts, ctl, holdings, workers, recorder
        self.env_for = env_for  # the start request's environment (launcher.loop.start_request)
        self.error_root = Path(error_root)  # world-<restart count>/rank-<R>/error.json (launcher.loop.rank_errors)
        self.log = recorder.log
        self.rdzv = ScriptRendezvous(ctl.host, self.log)
        self.current: RankMap | None = None
        self.count = 0  # TORCHELASTIC_RESTART_COUNT of the running world
        self.killed: list[str] = []  # nodes whose workers the last stop_world had to SIGKILL
        self.failures = 0
        self.recorded = False  # the running world's rank map is in the database
        self.output_at: dict[Path, int] = {}  # the workers' output files' sizes when this world started
        self.last_step = 0  # the last step the script reported (launcher.runtime.report_step): `elastic jobs`
        self.resuming: tuple[int, int] | None = None  # (restart's migration, last step before it): no report since

    # -- one world ------------------------------------------------------------------------------
    def layout(self, nodes: list[str]) -> RankMap:
        devices = tuple(d for n in nodes for d in self.holdings.node_devices(n))
        return RankMap(ParallelConfig(dp=len(devices)), devices)

    def start_world(self, nodes: list[str]) -> None:
        """Start every worker of `nodes` as one torchrun world (a fresh rendezvous store)."""
        nodes = self.holdings.in_order(nodes)
        sizes = [len(self.holdings.node_devices(n)) for n in nodes]
        port = self.rdzv.new_world(sum(sizes))
        shutil.rmtree(self.error_dir(), ignore_errors=True)  # an earlier run's files of the same world number
        self.output_at = {f: f.stat().st_size for n in nodes for f in
                          self.workers.backend.output_files(n, self.holdings.node_devices(n)) if f.exists()}
        for pos, n in enumerate(nodes):
            env = {**self.env_for(0),
                   **torchrun_env(master_addr=self.opts.master_addr, master_port=port, node_rank=pos,
                                  node_sizes=sizes, restart_count=self.count,
                                  run_id=f"{self.opts.job_name}-{self.recorder.job_id}",
                                  max_restarts=self.opts.max_restarts, error_dir=str(self.error_dir())),
                   **srun_world_env(nodes, pos, sizes)}
            self.ctl.forget_workers(self.holdings.node_devices(n))  # an earlier world's processes said hello and ready
            self.log(f"starting workers on {n} (restart {self.count}, group rank {pos})")
            self.workers.start(n, env, worker_command(self.opts.command))
        self.current = self.layout(nodes)

    def record_world(self) -> None:
        """The first world's rank map, once: at the start, or in auto mode once the world shows it trains as a
        restart-mode one (its rendezvous formed, a worker ended, a restart) -- a program that joins through
        launcher.runtime instead never trained on it, and its rank maps start with its first live layout."""
        if not self.recorded:
            self.recorded = True
            self.recorder.rank_map(self.count, str(self.current.layout), self.holdings.entries(self.current),
                                   update_job=False)

    def wait_formed(self, timeout: float) -> None:
        """Until the new world's rendezvous formed; MigrationFailed when a worker exits first or time runs out."""
        deadline = time.monotonic() + timeout
        while not self.rdzv.formed():
            done = self.workers.dead(all_codes=True)
            if done:
                raise MigrationFailed(f"workers {sorted(done)} exited (codes {sorted(set(done.values()))}) before "
                                      f"the new world formed; {self.workers.log_hint(done)}")
            if time.monotonic() > deadline:
                raise MigrationFailed(f"the script's rendezvous did not form within {timeout:.0f} s")
            if (line := self.rdzv.progress()) is not None:
                self.log(line)
            time.sleep(0.05)

    def stop_world(self) -> float:
        """SIGTERM every worker, SIGKILL after --term-timeout; returns the seconds it took. The nodes whose
        workers had to be killed are in `self.killed` (a restart's history says so: such a pause is the
        timeout's, not the script's)."""
        t0 = time.perf_counter()
        self.workers.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.opts.term_timeout
        self.killed = []
        for n in list(self.workers.handles):
            if not self.workers.reap(n, max(deadline - time.monotonic(), 0.0)):
                self.killed.append(n)
        return time.perf_counter() - t0

    def killed_note(self) -> list[str]:
        """The history note of the last stop_world when it had to SIGKILL, else none."""
        if not self.killed:
            return []
        return [f"workers on {','.join(self.killed)} did not exit within --term-timeout "
                f"{self.opts.term_timeout:g} s of SIGTERM; killed"]

    # -- a restart, recorded like a migration ---------------------------------------------------------
    def migrate_to(self, target: list[str], trigger: str, failed=(), ready_timeout=None, note: str = "") -> Outcome:
        """Stop the world, give back the nodes not in `target`, start the new world on `target`."""
        rec = self.recorder
        self.record_world()
        target, before = self.holdings.in_order(target), self.workers.active
        new = self.layout(target)
        out = Outcome(trigger, False, "", from_layout=str(self.current.layout), to_layout=str(new.layout),
                      nodes_before=len(before), nodes_after=len(before))
        rec.begin(out, {"restart": self.count + 1, "nodes": target, "from_nodes": before}, kind="restart")
        done = sorted(d for d, rc in self.workers.exited().items() if rc == 0)
        if done and trigger != "failure":  # the script completed on them: a new world would only find it done
            return rec.failed(out, f"declined: the job finished (workers {done} completed the script) before the "
                                   f"restart could apply", "declined")
        self.log(f"restart {self.count + 1}: {out.from_layout} on {','.join(before)} -> {out.to_layout} on "
                 f"{','.join(target)} ({trigger}); stopping the workers")
        stop_s = self.stop_world()
        self.reported(rec.take_steps(self.ctl))  # the old world's last reports: the new world's come after
        killed = self.killed_note()
        rec.notes(out.migration_id, killed)
        error, notes = self.holdings.release([n for n in before if n not in target], out.migration_id)
        self.count += 1
        t1 = time.perf_counter()
        try:
            self.start_world(target)
            self.wait_formed(self.opts.ready_timeout)
        except MigrationFailed as exc:
            return rec.failed(out, f"restart {self.count} failed: {exc}", phases={"stop": stop_s})
        out.phases = {"stop": stop_s, "start": time.perf_counter() - t1}
        rec.rank_map(self.count, str(new.layout), self.holdings.entries(new))
        rec.succeeded(out, error=error)
        rec.db.set_pause(out.migration_id, sum(out.phases.values()))
        self.resuming = (out.migration_id, self.last_step)
        out.ok, out.nodes_after = error is None, len(self.workers.active)
        out.message = error or (f"restarted: {out.from_layout} -> {out.to_layout}, {len(before)} -> "
                                f"{out.nodes_after} nodes (restart {self.count})")
        for n in killed + notes:
            out.message += "; " + n
        self.log(out.message + f" (stop {out.phases['stop']:.2f}s, start {out.phases['start']:.2f}s)")
        return rec.keep(out)

    def reported(self, reports: list) -> None:
        """Steps the script reported (launcher.runtime.report_step: (step, loss, layout), in order): the job's
        last step, and, for the first report after a restart, where the new world went on from (the step
        before it: the script's own checkpoint) and the steps it runs again, in the restart's history."""
        if not reports:
            return
        if self.resuming is not None:
            mid, before = self.resuming
            self.resuming = None
            at = max(reports[0][0] - 1, 0)
            self.recorder.db.set_resume_step(mid, at, max(before - at, 0))
            self.log(f"restart {self.count}: the script went on from step {at}"
                     + (f", {before - at} steps run again" if before > at else ""))
        self.last_step = reports[-1][0]
        self.recorder.db.update_job(self.recorder.job_id, last_step=self.last_step)

    def error_dir(self) -> Path:
        """Where the running world's ranks write their error files (TORCHELASTIC_ERROR_FILE)."""
        return self.error_root / f"world-{self.count}"

    def first_failure(self, dead: dict[int, int]) -> str | None:
        """The running world's first failure as torchrun names it (rank, node, exception), logged with its
        traceback: from the error files @record wrote, else from the output files of the `dead` workers
        (rank_errors.logged_failure); None when neither has one (a signal, output not in files)."""
        found = first_failure(self.error_dir()) or self._logged_failure(dead)
        if found is None or found.rank >= len(self.current.devices):
            return None
        line = found.line(self.holdings.node_of(self.current.devices[found.rank]))
        self.log(line + ("\n" + found.traceback.rstrip() if found.traceback else ""))
        return line

    def _logged_failure(self, dead: dict[int, int]):
        """The earliest last traceback in the output files of the `dead` workers of this world; a file that
        holds several workers' output (one srun step's) names them all, not one rank."""
        devices = list(self.current.devices)
        ranks: dict[Path, list[int]] = {}
        for r, d in enumerate(devices):
            for f in self.workers.backend.output_files(self.holdings.node_of(d), [d]):
                ranks.setdefault(f, []).append(r)
        found = [f for path, rs in ranks.items() if any(devices[r] in dead for r in rs)
                 and (f := logged_failure(rs[0], path, "" if len(rs) == 1 else f"one of ranks "
                                          f"{','.join(map(str, rs))}", self.output_at.get(path, 0))) is not None]
        return min(found, key=lambda f: (f.timestamp, f.rank), default=None)

    def on_failure(self, dead: dict[int, int]) -> Outcome:
        """A worker failed: restart the whole world on the same nodes (torchrun's --max-restarts). A worker
        of the new world that fails before it formed (a script that crashes on every start) is a failure
        too: it counts, and the world is restarted again until --max-restarts is used up. The first
        failure a rank recorded (@record) goes into the restart's history notes and the job's end."""
        while True:
            self.failures += 1
            self.log(f"workers {sorted(dead)} failed: {exit_codes(dead)}; {self.workers.log_hint(dead)}")
            cause = self.first_failure(dead)
            if self.failures > self.opts.max_restarts:
                why = f"workers {sorted(dead)} failed and --max-restarts {self.opts.max_restarts} is used up"
                return self.recorder.keep(Outcome("failure", False, why + (f"; {cause}" if cause else "")))
            out = self.migrate_to(self.workers.active, "failure")
            if cause and out.migration_id is not None:
                self.recorder.notes(out.migration_id, [cause])
            dead = {d: rc for d, rc in self.workers.dead(all_codes=True).items() if rc != 0}
            if out.ok or not dead:
                return out

    def poll(self) -> bool:
        """The world's own checks of one poll; False once the job is over."""
        exited = self.workers.dead(all_codes=True)
        if exited or self.rdzv.formed():
            self.record_world()
        if self.recorded and (line := self.rdzv.progress()) is not None:  # auto mode: not before it is decided
            self.log(line)
        if any(rc != 0 for rc in exited.values()):
            out = self.on_failure({d: rc for d, rc in exited.items() if rc != 0})
            if not out.ok:
                self.log(f"cannot recover: {out.message}; stopping the job")
                self.stop_world()
                self.recorder.job_state("failed", why=out.message)
                return False
            return True
        if self.current and set(self.current.devices) <= set(exited):
            self.log("workers finished")
            self.workers.handles.clear()
            self.recorder.job_state("finished")
            return False
        return True

    def stop(self) -> None:
        self.stop_world()
        self.recorder.job_state("stopped")

    def suspend(self, trigger: str) -> Outcome:
        n = len(self.workers.active)
        return self.recorder.keep(Outcome(trigger, False, "suspend needs the job's own checkpoints; in restart mode "
                                          "the program keeps its own (stop the job instead)",
                                          from_layout=str(self.current.layout), nodes_before=n, nodes_after=n))

    def close(self) -> None:
        self.rdzv.close()
