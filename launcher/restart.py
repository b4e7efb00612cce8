"""Restart mode: torchrun's contract for a program that does not use the runtime API.

Every worker gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID). MASTER_PORT is a
rendezvous store that belongs to the script's world -- hosted by the launcher, a fresh one for
every world, as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE=True makes `init_process_group`
connect to it as a client on every rank) -- never the launcher's own control-plane store.

On a resize, a preemption, Slurm's warning signal or a worker failure the launcher stops every
worker (SIGTERM, SIGKILL after --term-timeout), and starts the new world on the new node set; the
script resumes from its own checkpoint. This module holds the pure parts (the environment) and
the script's rendezvous; the launcher (launcher.launch) records each restart like a migration.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from datetime import timedelta

from launcher.torchrun_exec import ENV_RANK_BASE
from launcher.transaction import release_departed


def torchrun_env(*, master_addr: str, master_port: int, node_rank: int, node_sizes: Sequence[int],
                 restart_count: int, run_id: str) -> dict[str, str]:
    """The node-level torchrun variables of node `node_rank` of a world whose nodes run `node_sizes`
    workers each (uneven nodes differ); launcher.torchrun_exec adds the per-process RANK and LOCAL_RANK
    from ELASTIC_RANK_BASE, the rank of the node's first worker (GROUP_RANK x LOCAL_WORLD_SIZE only when
    nodes are alike)."""
    world = sum(node_sizes)
    return {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "GROUP_RANK": str(node_rank),
            "GROUP_WORLD_SIZE": str(len(node_sizes)), "LOCAL_WORLD_SIZE": str(node_sizes[node_rank]),
            "WORLD_SIZE": str(world), ENV_RANK_BASE: str(sum(node_sizes[:node_rank])),
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world), "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_MAX_RESTARTS": "-1", "OMP_NUM_THREADS": "1"}


def worker_command(command) -> list[str]:
    """What a node starts per worker: launcher.torchrun_exec sets RANK/LOCAL_RANK, then runs `command`."""
    return ["python", "-m", "launcher.torchrun_exec", "--", *command]


class ScriptRendezvous:
    """The script's own rendezvous: a TCPStore hosted here, a new one for each world (restart)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.store = None
        self.world_size = 0
        self.opened = 0.0

    def new_world(self, world_size: int) -> int:
        """Drop the previous world's store and open a fresh one; returns its port."""
        import torch.distributed as dist

        self.store = None  # the old server shuts down with its last reference
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=300))
        self.world_size, self.opened = world_size, time.monotonic()
        return self.store.port

    def formed(self) -> bool:
        """True once the script's process group is up: gloo and NCCL publish one key per rank."""
        return self.store is not None and self.store.num_keys() >= self.world_size

    def close(self) -> None:
        self.store = None


class RestartMode:
    """The restart-mode half of one job's control loop (launcher.loop.Launcher delegates to it).

    Each world is every device of the nodes it runs on, recorded as a rank map of layout
    pp1tp1dp<W>; each restart is recorded as a migration of kind `restart` with phases `stop`
    (SIGTERM until every worker ended) and `start` (new processes until the script's rendezvous
    formed), and pause_s = both: what the launcher can see of the time training stood still (the
    script's own checkpoint load and first step come on top).
    """

    def __init__(self, la) -> None:
        self.la = la
        self.rdzv = ScriptRendezvous(la.ctl.host)
        self.count = 0  # TORCHELASTIC_RESTART_COUNT of the running world
        self.killed: list[str] = []  # nodes whose workers the last stop_world had to SIGKILL
        self.failures = 0

    # -- one world ------------------------------------------------------------------------------
    def layout(self, nodes: list[str]):
        from migrate.layout import ParallelConfig
        from migrate.topology import RankMap

        devices = tuple(d for n in nodes for d in self.la.node_devices(n))
        return RankMap(ParallelConfig(dp=len(devices)), devices)

    def start_world(self, nodes: list[str]) -> None:
        """Start every worker of `nodes` as one torchrun world (a fresh rendezvous store)."""
        la = self.la
        nodes = [n for n in la.alloc if n in set(nodes)]
        sizes = [len(la.node_devices(n)) for n in nodes]
        port = self.rdzv.new_world(sum(sizes))
        for pos, n in enumerate(nodes):
            env = {**la.request.env(la.epoch + 1),
                   **torchrun_env(master_addr=la.opts.master_addr, master_port=port, node_rank=pos, node_sizes=sizes,
                                  restart_count=self.count, run_id=f"{la.opts.job_name}-{la.job_id}")}
            for d in la.node_devices(n):  # an earlier world's processes said these
                la.ctl.store.delete_key(f"hello/{d}")
                la.ctl.store.delete_key(f"ready/{d}")
            la.log(f"starting workers on {n} (restart {self.count}, group rank {pos})")
            la.handles[n] = la.backend.start(n, la.index[n], env, worker_command(la.opts.command))
        la.current = self.layout(nodes)

    def wait_formed(self, timeout: float) -> None:
        """Until the new world's rendezvous formed; MigrationFailed when a worker exits first or time runs out."""
        from launcher.transaction import MigrationFailed

        deadline = time.monotonic() + timeout
        while not self.rdzv.formed():
            done = self.la.dead(all_codes=True)
            if done:
                raise MigrationFailed(f"workers {sorted(done)} exited (codes {sorted(set(done.values()))}) before "
                                      f"the new world formed; {self.la.log_hint(done)}")
            if time.monotonic() > deadline:
                raise MigrationFailed(f"the script's rendezvous did not form within {timeout:.0f} s")
            time.sleep(0.05)

    def stop_world(self) -> float:
        """SIGTERM every worker, SIGKILL after --term-timeout; returns the seconds it took. The nodes whose
        workers had to be killed are in `self.killed` (a restart's history says so: such a pause is the
        timeout's, not the script's)."""
        la = self.la
        t0 = time.perf_counter()
        handles = list(la.handles.items())
        for _n, h in handles:
            la.backend.signal(h, signal.SIGTERM)
        deadline = time.monotonic() + la.opts.term_timeout
        self.killed = []
        for n, h in handles:
            if not la.backend.stop(h, max(deadline - time.monotonic(), 0.0)):
                self.killed.append(n)
                la.log(f"workers on {n} ignored SIGTERM for {la.opts.term_timeout:.0f} s; killed them")
            la.handles.pop(n, None)
        return time.perf_counter() - t0

    def killed_note(self) -> list[str]:
        """The history note of the last stop_world when it had to SIGKILL, else none."""
        if not self.killed:
            return []
        return [f"workers on {','.join(self.killed)} did not exit within --term-timeout "
                f"{self.la.opts.term_timeout:g} s of SIGTERM; killed"]

    # -- a restart, recorded like a migration ---------------------------------------------------------
    def restart_to(self, target: list[str], trigger: str):
        """Stop the world, give back the nodes not in `target`, start the new world on `target`."""
        from launcher.transaction import MigrationFailed, Outcome

        la = self.la
        target = [n for n in la.alloc if n in set(target)]
        before, old = la.active, la.current
        new = self.layout(target)
        out = Outcome(trigger, False, "", from_layout=str(old.layout), to_layout=str(new.layout),
                      nodes_before=len(before), nodes_after=len(before))
        summary = {"restart": self.count + 1, "nodes": target, "from_nodes": before}
        mid = la.db.start_migration(la.job_id, out.from_layout, out.to_layout, trigger, summary,
                                    la.db.fragmentation(la.job_id), kind="restart")
        out.migration_id = mid
        la.log(f"restart {self.count + 1}: {out.from_layout} on {','.join(before)} -> {out.to_layout} on "
               f"{','.join(target)} ({trigger}); stopping the workers")
        stop_s = self.stop_world()
        killed = self.killed_note()
        if killed:
            la.db.add_migration_notes(mid, killed)
        leaving = [n for n in before if n not in target]
        error, notes = release_departed(la, leaving, mid)
        notes = killed + notes
        self.count += 1
        t1 = time.perf_counter()
        try:
            self.start_world(target)
            self.wait_formed(la.opts.ready_timeout)
        except MigrationFailed as exc:
            out.message = f"restart {self.count} failed: {exc}"
            la.db.finish_migration(mid, "failed", None, None, None, {"stop": stop_s}, error=out.message)
            la.outcomes.append(out)
            la.log(out.message)
            return out
        phases = {"stop": stop_s, "start": time.perf_counter() - t1}
        la.db.record_rank_map(la.job_id, la.epoch_base + self.count, str(new.layout), la.entries(new))
        la.db.update_job(la.job_id, layout=str(new.layout))
        la.db.finish_migration(mid, "succeeded", None, None, None, phases, error=error,
                               fragmentation_after=la.db.fragmentation(la.job_id))
        la.db.set_pause(mid, sum(phases.values()))
        out.ok, out.phases, out.nodes_after = error is None, phases, len(la.active)
        out.message = error or (f"restarted: {out.from_layout} -> {out.to_layout}, {len(before)} -> "
                                f"{out.nodes_after} nodes (restart {self.count})")
        for note in notes:
            out.message += "; " + note
        la.log(out.message + f" (stop {phases['stop']:.2f}s, start {phases['start']:.2f}s)")
        la.outcomes.append(out)
        return out

    def on_failure(self, dead: dict[int, int]):
        """A worker failed: restart the whole world on the same nodes (torchrun's --max-restarts). A worker
        of the new world that fails before it formed (a script that crashes on every start) is a failure
        too: it counts, and the world is restarted again until --max-restarts is used up."""
        from launcher.transaction import Outcome

        la = self.la
        while True:
            self.failures += 1
            la.log(f"workers {sorted(dead)} failed (exit codes {sorted(set(dead.values()))}); {la.log_hint(dead)}")
            if self.failures > la.opts.max_restarts:
                out = Outcome("failure", False, f"workers {sorted(dead)} failed and --max-restarts "
                                                f"{la.opts.max_restarts} is used up")
                la.outcomes.append(out)
                return out
            out = self.restart_to(la.active, "failure")
            dead = {d: rc for d, rc in la.dead(all_codes=True).items() if rc != 0}
            if out.ok or not dead:
                return out

    def poll_once(self) -> bool:
        """One round of checks in restart mode; False once the job is over."""
        la = self.la
        exited = la.dead(all_codes=True)
        if any(rc != 0 for rc in exited.values()):
            out = self.on_failure({d: rc for d, rc in exited.items() if rc != 0})
            if not out.ok:
                la.log(f"cannot recover: {out.message}; stopping the job")
                self.stop_world()
                la.stopped = True
                la.db.set_job_state(la.job_id, "failed", why=out.message)
                return False
            return True
        if la.current and set(la.current.devices) <= set(exited):
            la.log("workers finished")
            la.handles.clear()
            la.stopped = True
            la.db.set_job_state(la.job_id, "finished")
            return False
        if la.signalled:
            la.signalled = False
            if la.opts.on_signal != "ignore" and len(la.active) > la.opts.min_nodes:
                la.shrink_to(la.opts.min_nodes, "signal")
        for req in la.db.take_requests(la.job_id):  # claimed one at a time (SKIP LOCKED)
            la.handle_request(req)
            if la.stopped:
                return False
        return True

    def close(self) -> None:
        self.rdzv.close()
