"""What a trigger led to, recorded: the Outcome of every trigger, and the outcomes that are not a live move.

A live move (a resize, a preemption, USR1, a worker that died and left a replica) is
launcher.loop.live.move: plan, record, publish, commit or veto, release, record. `Transaction`
records the rest, each as one outcome: a refusal before anything moves (no plan, no nodes to be
had), a decline, and a restore from the safety checkpoint. A migration that does not commit
leaves the job on its old layout (the workers resume it, or the next poll recovers from the dead);
a node release that fails after the commit leaves the job on the new layout with the nodes still
allocated, and says so (`release_departed`).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.loop.launcher import Launcher


class MigrationFailed(RuntimeError):
    """A migration (or start) could not complete; the message says why."""

    status = "failed"  # how the migration is recorded


class TrainingEnded(MigrationFailed):
    """The workers finished their last step (exit code 0) before the migration could apply: nothing is
    left to move, so the migration is recorded as declined, not failed, and the old layout is not
    resumed (its workers have exited)."""

    status = "declined"


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
    pause_s: float | None = None  # set once the new layout committed its first step (launcher.loop.pauses)
    marks: dict = field(default_factory=dict)  # device -> {mark: wall time} its worker reported (launcher.loop.timeline)
    worlds: tuple[str, str] | None = None  # (old, new) training world: the pause runs from one to the other


class Transaction:
    """One outcome of `job` for `trigger` that is not a live move. Use once: `restore`, `refuse` or `decline`."""

    def __init__(self, job: "Launcher", trigger: str) -> None:
        self.job, self.trigger = job, trigger
        n = len(job.active)
        self.out = Outcome(trigger, False, "", from_layout=str(job.current.layout), nodes_before=n, nodes_after=n)

    # -- outcomes without a plan ------------------------------------------------------------------
    def refuse(self, message: str, to_layout: str = "?", summary: dict | None = None) -> Outcome:
        """Record a migration that failed before anything moved (no plan, no nodes to be had)."""
        db, out = self.job.db, self.out
        out.message = message
        mid = db.start_migration(self.job.job_id, out.from_layout, to_layout, self.trigger, summary or {},
                                 db.fragmentation(self.job.job_id))
        db.finish_migration(mid, "failed", None, None, None, {}, error=message)
        out.migration_id = mid
        self.job.log(f"{self.trigger}: {message}")
        return self._done()

    def decline(self, message: str) -> Outcome:
        """An outcome that is not a migration at all (nothing recorded in the migrations table)."""
        self.out.message = message
        return self._done()

    def _done(self) -> Outcome:
        self.job.outcomes.append(self.out)
        return self.out

    def _kill(self, nodes: Sequence[str]) -> None:
        for n in nodes:
            h = self.job.handles.pop(n, None)
            if h is not None:
                h.kill()

    # -- a restore from a safety checkpoint ---------------------------------------------------------
    def restore(self, keep: list[str], path: str, step: int) -> Outcome:
        """Restart the workers on the nodes `keep` from the safety checkpoint of `step` (a failure the
        replicas cannot cover). Recorded as a migration with the committed steps lost."""
        from migrate.layout import LayoutError
        from migrate.topology import RankMap

        job, out = self.job, self.out
        lost = max(job.max_step() - step, 0)
        self._kill(list(job.handles))  # the survivors hold an incomplete state: start over from the checkpoint
        try:
            layout = job.choose(sum(len(job.node_devices(n)) for n in keep))
        except LayoutError as exc:
            return self.refuse(f"no layout for the nodes left: {exc}")
        devices = tuple(d for n in keep for d in job.node_devices(n))[:layout.world_size]
        out.to_layout = str(layout)
        out.migration_id = job.db.start_migration(job.job_id, out.from_layout, out.to_layout, self.trigger,
                                                  {"restore_from": path, "step": step},
                                                  job.db.fragmentation(job.job_id))
        e = job.epoch + 1
        t0 = time.perf_counter()
        job.lost -= {d for n in keep for d in job.node_devices(n)}  # every worker of `keep` starts afresh
        try:
            job.ctl.forget_workers([d for n in keep for d in job.node_devices(n)], step)
            job.start_nodes(keep, e)
            job.wait_ready(keep)
            job.epoch = e
            job.ctl.post({"epoch": e, "kind": "start", "layout": str(layout), "devices": list(devices),
                          "checkpoint": path, "urgent": True})
            job.check_results(job.wait_results(e, list(devices)))
        except MigrationFailed as exc:
            out.message = f"restore from checkpoint at step {step} failed: {exc}"
            job.db.finish_migration(out.migration_id, "failed", None, None, None, {}, error=out.message, at_step=step)
            job.log(out.message)
            return self._done()
        job.pauses.add(out.migration_id, job.world, f"w{e}", out)
        job.current, job.world = RankMap(layout, devices), f"w{e}"
        job.db.record_rank_map(job.job_id, job.epoch_base + e, out.to_layout, job.entries(job.current))
        job.record_survival()
        out.ok, out.at_step, out.nodes_after = True, step, len(job.active)
        out.phases = {"rebuild": time.perf_counter() - t0}
        out.message = f"restored from checkpoint at step {step}: {lost} steps lost"
        size = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
        job.db.finish_migration(out.migration_id, "succeeded", None, size, None, out.phases, error=out.message,
                                fragmentation_after=job.db.fragmentation(job.job_id), at_step=step,
                                steps_lost=lost)
        job.log(f"{out.from_layout} -> {out.to_layout}: {out.message}")
        return self._done()


def release_departed(job: "Launcher", leaving: list[str], migration_id: int) -> tuple[str | None, list[str]]:
    """Give the departed nodes back after a committed move (NodeBackend.release): (error, notes).

    One place for every kind of move (ETC transaction, live reshard, restart), so each records the
    same node states: a node Slurm would not let go stays allocated, idle, and the backend's notes
    (which component gave what back, the fallback where Slurm refused) go into the audit log and
    the migration's history.
    """
    if not leaving:
        return None, []
    keep = [n for n in job.alloc if n not in leaving and n not in job.gone]
    try:
        notes = job.backend.release(keep)
    except Exception as exc:  # SlurmError: the job keeps running, the nodes stay allocated
        for n in leaving:
            job.db.set_node_state(job.job_id, n, "idle")
        return f"node release failed (nodes stay allocated, idle): {exc}", []
    for n in leaving:
        job.db.set_node_state(job.job_id, n, "idle" if job.backend.holds(n) else "released")
    for note in notes:
        job.db.audit("elastic-launch", "release", f"job:{job.job_id}", note)
    if notes:  # in the migration's history too (its plan summary's notes)
        job.db.add_migration_notes(migration_id, notes)
    return None, notes
