"""One migration of a running job as a transaction: plan → record → publish → commit or veto → release → record.

Every trigger (a resize, a preemption, USR1, a worker that died, a restore from a safety
checkpoint) goes through the same object: the control loop (launcher.loop) only decides the
target nodes and the trigger; `Transaction` does the rest and always ends in one recorded
outcome. A migration that does not commit leaves the job on its old layout (the workers resume
it, or the next poll recovers from the dead); a node release that fails after the commit
leaves the job on the new layout with the nodes still allocated, and says so.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.loop import Launcher


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
    pause_s: float | None = None  # set once the new layout committed its first step (launcher.pause)
    marks: dict = field(default_factory=dict)  # device -> {mark: wall time} its worker reported (launcher.timeline)
    worlds: tuple[str, str] | None = None  # (old, new) training world: the pause runs from one to the other


class Transaction:
    """One migration of `job` for `trigger`. Use once: `move`, `restore` or `refuse`."""

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

    # -- a planned move -----------------------------------------------------------------------------
    def move(self, target: list[str], failed: Sequence[int] = (), ready_timeout: float | None = None,
             note: str = "") -> Outcome:
        """Move the job onto the nodes `target` (pinned node included) with the next layout."""
        job = self.job
        target = [n for n in job.alloc if n in set(target)]
        p = self._plan(target, failed)
        if p is None:
            return self.out
        self._record_start(p)
        before = job.active
        new_nodes = [n for n in target if n not in job.handles]
        leaving = [n for n in before if n not in target]
        e = job.epoch + 1
        try:
            if new_nodes:
                job.start_nodes(new_nodes, e)
                job.wait_ready(new_nodes, ready_timeout, note)
            results = self._publish_and_wait(p, e, target, leaving, new_nodes, bool(failed))
        except MigrationFailed as exc:
            self._kill(new_nodes)
            job.db.finish_migration(self.out.migration_id, exc.status, p.bytes_moved, p.bytes_checkpoint, None,
                                    self.phases, error=str(exc))
            if isinstance(exc, TrainingEnded):
                job.log(f"{self.trigger}: {exc}")
                return self.decline(str(exc))
            return self._roll_back(str(exc), failed)
        for name in ("build_groups", "execute", "rebuild", "other"):
            self.phases[name] = max((r["phases"].get(name, 0.0) for r in results.values()), default=0.0)
        self.out.phases = self.phases
        self.out.marks = {d: r.get("marks", {}) for d, r in results.items()}
        bad = [r["error"] for r in results.values() if not r["ok"]]
        if bad:  # vetoed: every participant kept its old state
            msg = "migration aborted, old layout kept: " + bad[0]
            job.db.finish_migration(self.out.migration_id, "failed", p.bytes_moved, p.bytes_checkpoint, False,
                                    self.phases, error=msg)
            self._kill(new_nodes)
            return self._roll_back(msg, failed)
        self._commit(p, e, leaving)
        error, notes = release_departed(job, leaving, self.out.migration_id)
        return self._finish(p, results, len(before), error, notes)

    def _plan(self, target: list[str], failed: Sequence[int]):
        """The MigrationPlan onto `target`, or None after recording why there is none."""
        from migrate.instructions import LostStateError
        from migrate.layout import LayoutError
        from migrate.plan import plan
        from migrate.topology import Topology

        job, layout = self.job, None
        unusable = frozenset(job.lost - set(failed))  # lost earlier, outside the current layout
        try:
            layout = job.choose(sum(len(job.node_devices(n)) for n in target)
                                - len([d for d in set(failed) | unusable if job.topology.devices[d].node in target]))
            t0 = time.perf_counter()
            p = plan(job.model, job.current, layout, Topology(job.topology.devices, frozenset(target)),
                     frozenset(failed), placement=job.opts.placement, unusable=unusable)
            self.phases = {"plan": time.perf_counter() - t0}
            stray = sorted({job.topology.devices[d].node for d in p.curr.devices} - set(target))
            if stray:
                raise LayoutError(f"the planner placed ranks on {stray}, outside the target nodes {target}")
        except (LayoutError, LostStateError) as exc:
            self.refuse(f"no plan: {exc}", str(layout) if layout is not None else "?")
            return None
        return p

    def _record_start(self, p) -> None:
        job, out = self.job, self.out
        out.to_layout = str(p.curr.layout)
        out.bytes_moved, out.bytes_checkpoint = p.bytes_moved, p.bytes_checkpoint
        out.migration_id = job.db.start_migration(job.job_id, out.from_layout, out.to_layout, self.trigger,
                                                  p.summary(), job.db.fragmentation(job.job_id))

    def _publish_and_wait(self, p, e: int, target: list[str], leaving: list[str], new_nodes: list[str],
                          urgent: bool) -> dict[int, dict]:
        """Post the plan as event `e` and wait for every participant's result (commit or veto)."""
        job = self.job
        participants = sorted((set(p.prev.devices) - set(p.failed)) | set(p.curr.devices))
        job.epoch = e
        job.ctl.post({"epoch": e, "kind": "migrate", "plan": p.to_dict(instructions=False), "participants": participants,
                      "exit_ok": sorted(d for n in leaving for d in job.node_devices(n)),
                      "exit_fail": sorted(d for n in new_nodes for d in job.node_devices(n)), "urgent": urgent,
                      "release_early": job.opts.release_early})
        job.log(f"event {e}: {self.out.from_layout} -> {self.out.to_layout} on {','.join(target)} ({self.trigger})")
        results = job.wait_results(e, participants)
        self.out.at_step = job.ctl.at(e)
        if urgent:
            steps = {r["step"] for r in results.values() if r.get("ok") and r.get("step") is not None}
            self.out.at_step = min(steps) if steps else None
        return results

    def _kill(self, nodes: Sequence[str]) -> None:
        for n in nodes:
            h = self.job.handles.pop(n, None)
            if h is not None:
                h.kill()

    def _roll_back(self, message: str, failed: Sequence[int]) -> Outcome:
        """The migration did not commit: the old layout trains on (or the next poll recovers)."""
        self.out.message = message
        self._done()
        self.job.resume_old(failed)
        return self.out

    def _commit(self, p, e: int, leaving: list[str]) -> None:
        """The new layout trains; the departing workers exit."""
        job = self.job
        job.pauses.add(self.out.migration_id, job.world, f"w{e}", self.out)
        self.out.worlds = (job.world, f"w{e}")
        job.current, job.world = p.curr, f"w{e}"
        job.db.record_rank_map(job.job_id, job.epoch_base + e, self.out.to_layout, job.entries(p.curr))
        job.record_survival()
        for n in leaving:
            job.reap(n)

    def _finish(self, p, results: dict[int, dict], nodes_before: int, error: str | None,
                notes: list[str]) -> Outcome:
        job, out = self.job, self.out
        out.bit_exact = all(r.get("units_verified", 0) > 0 for r in results.values() if r.get("step") is not None)
        job.db.finish_migration(out.migration_id, "succeeded", p.bytes_moved, p.bytes_checkpoint, out.bit_exact,
                                self.phases, error=error, fragmentation_after=job.db.fragmentation(job.job_id))
        out.ok = error is None
        out.nodes_after = len(job.active)
        out.message = error or f"{out.from_layout} -> {out.to_layout}, {nodes_before} -> {out.nodes_after} nodes"
        for note in notes:
            out.message += "; " + note
        job.log(out.message + f" (at step {out.at_step}, phases " +
                ", ".join(f"{k} {v:.3f}s" for k, v in self.phases.items()) + ")")
        return self._done()

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
            for n in keep:
                for d in job.node_devices(n):
                    job.ctl.store.delete_key(f"ready/{d}")  # the old processes' registrations
                    job.ctl.store.set(f"step/{d}", str(step))
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
