"""Live mode: the workers joined through launcher.runtime, and every trigger is a move of the running
state at one agreed step boundary (plan, record, publish, commit or veto, release, record).

The launcher picks the layout and devices (launcher.loop.live_plan), starts workers on new nodes, posts
one `reshard` event that applies at an agreed step boundary, waits for every participant, records the
rank map and the migration, and gives the nodes that left back. A migration that does not commit leaves
the job on its old layout (the workers resume it, or the next poll recovers from the dead); a node
release that fails after the commit leaves the job on the new layout with the nodes still allocated,
and says so. Failures and restores from the safety checkpoint: launcher.loop.recovery.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from launcher.loop import live_plan, suspend as suspending
from launcher.loop.autoscale import PolicyLoop
from launcher.loop.live_plan import LayoutError, ManifestError
from launcher.loop.outcome import MigrationFailed, Outcome, TrainingEnded
from launcher.loop.pauses import PendingPauses
from launcher.loop.drain import DrainWatch
from launcher.loop.probe import NodeProbe
from launcher.loop.stall import StallWatch
from migrate.topology import RankMap


class LiveMode:
    """One live-mode job's running layout (`current`, in training world `world`) and its events."""

    def __init__(self, opts, ctl, holdings, workers, recorder, start_nodes) -> None:
        self.opts, self.ctl, self.holdings, self.workers, self.recorder = opts, ctl, holdings, workers, recorder
        self.start_nodes = start_nodes  # (nodes, first event) -> None: the launcher starts workers from its request
        self.log = recorder.log
        self.current: RankMap | None = None
        self.epoch = -1  # last posted event
        self.world = "w0"  # the process-group world the current layout trains in
        self.pauses = PendingPauses()  # migrations whose pause is known once the new layout commits a step
        self.stall = StallWatch(self.log)  # steps that stop with no known cause are said (launcher.loop.stall)
        self.drain = DrainWatch(workers.backend.draining, self.log)  # nodes the cluster drains are left
        self.autoscale = PolicyLoop(opts, workers.backend, recorder, self.log)  # launcher.loop.autoscale
        self.restores = 0  # checkpoint restores after failures so far (count against --max-restarts)
        self.suspended = False
        self.ckpt_dir = ""  # the job's checkpoint folder (launcher.loop.start_request.checkpoint_dir)
        self.probe = NodeProbe(workers.backend, self, holdings, self.log)  # a node gone without a word
        self.survival_said = ""  # what the running layout survives, as last said on the console

    def max_step(self) -> int:
        devs = list(self.current.devices) if self.current else []
        return max(self.ctl.steps(devs).values(), default=0)

    # -- one event, every participant's answer --------------------------------------------------------
    def wait_results(self, e: int, participants: list[int]) -> dict[int, dict]:
        """Every participant's result of event `e`; vetoes the commit when one dies or time runs out.
        TrainingEnded when workers of the running layout exited with 0 instead: they finished their last
        step before the event could apply (e.g. a grow that took seconds to start its workers)."""
        deadline = time.monotonic() + self.opts.migrate_timeout
        while True:
            if self.ctl.reported(e, participants):
                return self.ctl.results(e, participants)
            dead = {d: rc for d, rc in self.workers.dead(all_codes=True).items() if d in participants}
            if dead:  # a worker that reported, then exited, is not dead
                dead = {d: rc for d, rc in dead.items() if not self.ctl.results(e, [d])}
            late = time.monotonic() > deadline
            if (dead or late) and self.ctl.veto_event(e):
                # every participant had voted yes already: the new layout stands
                return self._results_after_commit(e, participants, dead, deadline)
            if dead and not any(dead.values()) and set(dead) <= set(self.current.devices):
                raise TrainingEnded(f"declined: training ended (the workers finished their last step, step "
                                    f"{self.max_step()}) before the migration could apply")
            if dead:
                raise MigrationFailed(f"workers {sorted(dead)} exited during the migration (exit codes "
                                      f"{sorted(set(dead.values()))}); old layout kept")
            if late:
                silent = sorted(set(participants) - set(self.ctl.results(e, participants)))
                raise MigrationFailed(f"no result from devices {silent} within {self.opts.migrate_timeout:.0f} s "
                                      f"({self.ctl.where_workers_are(e, participants)})")
            time.sleep(0.05)

    def _results_after_commit(self, e: int, participants: list[int], dead: dict[int, int],
                              deadline: float) -> dict[int, dict]:
        self.ctl.abort_world(f"w{e}")  # survivors stop waiting for the dead to join it
        alive = [d for d in participants if d not in dead]
        while not self.ctl.reported(e, alive) and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        self.log(f"workers {sorted(dead)} died after the migration committed; new layout kept")
        return self.ctl.results(e, alive)

    def results(self, e: int, participants: list[int]) -> dict[int, dict]:
        """wait_results, then MigrationFailed with the first worker error among them."""
        results = self.wait_results(e, participants)
        bad = [r.get("error") for r in results.values() if not r.get("ok")]
        if bad:
            raise MigrationFailed(bad[0])
        return results

    def post(self, event: dict) -> int:
        """Post the next event; returns its number."""
        self.epoch += 1
        self.ctl.post({"epoch": self.epoch, **event})
        return self.epoch

    def resume_old(self, failed: Sequence[int]) -> None:
        """A migration did not commit: every participant kept its old state. When no worker of the old
        layout died, they train on again in a fresh world (event `resume`); otherwise the dead workers
        are found by the next poll and recovered from (launcher.loop.recovery)."""
        if failed or self.workers.dead():
            return
        e = self.post({"kind": "resume", "layout": str(self.current.layout), "devices": list(self.current.devices)})
        self.world = f"w{e}"
        self.log(f"event {e}: resume {self.current.layout} on its old devices")

    # -- a live move ----------------------------------------------------------------------------------
    def migrate_to(self, target: list[str], trigger: str, failed: Sequence[int] = (),
                   ready_timeout: float | None = None, note: str = "") -> Outcome:
        """Move the job onto the nodes `target` with the next layout (a recovery when `failed` devices died:
        urgent, every piece from a survivor); one recorded Outcome."""
        target, failed = self.holdings.in_order(target), sorted(failed)
        before = self.workers.active
        out = Outcome(trigger, False, "", from_layout=str(self.current.layout), nodes_before=len(before),
                      nodes_after=len(before))
        t_plan = time.perf_counter()
        try:
            new, cost = self._plan(target, failed)
        except (LayoutError, ManifestError) as exc:
            return self.recorder.refuse(out, f"no plan: {exc}")
        plan_s = time.perf_counter() - t_plan
        out.to_layout, out.bytes_checkpoint = str(new.layout), cost["bytes_checkpoint"]
        self.recorder.begin(out, {"generic": True, "from": out.from_layout, "to": out.to_layout, "nodes": target,
                                  "failed": failed, "placement": list(new.devices), **cost,
                                  "plan_ms": round(plan_s * 1000, 3)})
        new_nodes = [n for n in target if n not in self.workers.handles]
        leaving = [n for n in before if n not in target]
        t0 = time.perf_counter()
        try:
            e, results = self._run(out.migration_id, new, target, failed, new_nodes, leaving, trigger, ready_timeout,
                                    note)
        except MigrationFailed as exc:
            self.workers.kill(new_nodes)
            ended = isinstance(exc, TrainingEnded)  # declined: the old layout's workers have exited
            self.recorder.failed(out, str(exc) if ended else f"migration failed: {exc}", exc.status,
                                 {"plan": plan_s}, moved=cost["bytes_moved"], checkpoint=out.bytes_checkpoint)
            if not ended:
                self.resume_old(failed)
            return out
        out.phases = {k: max(r.get("phases", {}).get(k, 0.0) for r in results.values())
                      for k in ("build_groups", "execute", "rebuild", "other")}
        out.phases["plan"] = plan_s
        out.marks = {d: r.get("marks", {}) for d, r in results.items()}  # launcher.loop.timeline (bench --explain)
        return self._commit(out, new, e, results, failed, before, leaving, t0)

    def _plan(self, target: list[str], failed: list[int]):
        h = self.holdings
        unusable = set(self.workers.lost) - set(failed)
        avail = h.devices_on(target) - len([d for d in set(failed) | unusable if h.node_of(d) in target])
        layout = h.choose(avail)
        if (idle := h.idle_note(avail, layout)) is not None:
            self.log(idle)
        spec = self.ctl.model()
        new = RankMap(layout, live_plan.placement(spec, h.topology, self.opts.placement, layout, self.current, target,
                                                  failed, unusable))
        return new, live_plan.plan_bytes(spec, self.current, new, failed)

    def _run(self, migration_id, new, target, failed, new_nodes, leaving, trigger, ready_timeout, note):
        """Start the new nodes' workers, post the `reshard` event, wait for every participant's result."""
        old = self.current
        if new_nodes:
            self.start_nodes(new_nodes, self.epoch + 1)
            self.workers.wait_ready(self.ctl, new_nodes, self.opts.ready_timeout if ready_timeout is None
                                    else ready_timeout, note)
        parts = sorted((set(old.devices) - set(failed)) | set(new.devices))
        nd = self.holdings.node_devices
        e = self.post({"kind": "reshard", "participants": parts, "failed": failed, "urgent": bool(failed),
                       "release_early": self.opts.release_early,
                       "prev": {"layout": str(old.layout), "devices": list(old.devices)},
                       "curr": {"layout": str(new.layout), "devices": list(new.devices)},
                       "exit_ok": sorted(d for n in leaving for d in nd(n)),
                       "exit_fail": sorted(d for n in new_nodes for d in nd(n))})
        self.log(f"migration {migration_id} starts (event {e}): {old.layout} -> {new.layout} on {','.join(target)} "
                 f"({trigger})")
        return e, self.results(e, parts)

    def _commit(self, out, new, e, results, failed, before, leaving, t0) -> Outcome:
        """The move committed: the job runs on `new`; record it, let the departed go, say what happened."""
        out.worlds = (self.world, f"w{e}")
        self.pauses.add(out.migration_id, self.world, f"w{e}", out)
        self.current, self.world = new, f"w{e}"
        self.recorder.rank_map(e, str(new.layout), self.holdings.entries(new))
        self.record_survival()
        for n in leaving:
            self.workers.reap(n)
        error, notes = self.holdings.release(leaving, out.migration_id)
        steps = {r["step"] for r in results.values() if r.get("step") is not None}
        # the agreed step boundary (launcher.wire.control.agree_at); an urgent recovery applies at once, at
        # the step the survivors kept
        at = None if failed else self.ctl.at(e)
        out.at_step = at if at is not None else min(steps) if steps else None
        out.bytes_moved = sum(r.get("bytes_moved", 0) for r in results.values())
        # every message's digests compared at both ends (migrate.reshard.execute verify=True; a
        # mismatch anywhere fails every participant, so a committed move verified is bit-exact); where no
        # message crossed between processes (the survivors already held their state) nothing was checked,
        # and the record says so (null) instead of claiming a comparison that never ran
        pieces = sum(r.get("units_verified", 0) for r in results.values())
        out.bit_exact = all(r.get("verified") for r in results.values()) if pieces else None
        self.recorder.succeeded(out, out.bytes_moved, out.bytes_checkpoint, error)
        out.ok, out.nodes_after = error is None, len(self.workers.active)
        checked = f"{pieces} pieces verified" if pieces else "nothing moved"
        out.message = error or f"{out.from_layout} -> {out.to_layout}, {len(before)} -> {out.nodes_after} nodes " \
                               f"(live, at step {out.at_step}, {checked}, " \
                               f"{time.perf_counter() - t0:.2f} s)"
        for note in notes:
            out.message += "; " + note
        return self.recorder.done(out)

    # -- what the job runs on, said ------------------------------------------------------------------
    def record_survival(self) -> None:
        """Say what the running layout survives (the loss of one process, of one node): in the audit log and
        the job's launch spec (which the dashboard reads) after every move; on the console when it changed."""
        said = self.holdings.survival(self.current).describe()
        if said != self.survival_said:
            self.log(f"job {self.recorder.job_id}: {self.current.layout} {said}")
            self.survival_said = said
        self.recorder.audit("survival", f"{self.current.layout} {said}")
        self.recorder.db.set_launch_spec(self.recorder.job_id, self.holdings.launch_spec(self.current))

    # -- the end --------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every worker at one step boundary."""
        self.post({"kind": "stop"})
        self.finish_all("finished", timeout=120)

    def suspend(self, trigger: str) -> Outcome:
        return suspending.suspend(self, trigger)

    def watch(self, step: int) -> None:
        """Every poll (`step`: the workers' furthest step, as this poll read it): the pauses of past migrations
        that are now known, whether training stalled, the policy, and whether the cluster drains nodes the job
        can leave (a live shrink off them)."""
        self.pauses.settle(self.ctl, self.recorder.db, self.log)
        devices = list(self.current.devices) if self.current else []
        self.stall.check(self.world, self.ctl.commit_times(self.world)[1], step,
                         lambda: self.ctl.where_workers_are(self.epoch + 1, devices))
        active = self.workers.active
        self.autoscale.tick(len(active))
        leave = self.drain.due(active, self.opts.min_nodes, self.workers.backend.batch_node)
        if leave and self.current is not None:
            why = "; ".join(f"{n}: {w}" for n, w in leave.items())
            self.log(f"the cluster drains {', '.join(leave)} ({why}): moving the job off")
            self.recorder.audit("drain", f"the cluster drains {why}: the job leaves them")
            out = self.migrate_to([n for n in active if n not in leave], "preempt")
            if out.migration_id is not None:
                self.recorder.notes(out.migration_id, [f"drained by the cluster: {why}"])

    def finish_all(self, state: str | None, timeout: float) -> None:
        """Every worker ends (standby ones on a stop event); the job is recorded in `state` (None: left as is)."""
        for n in list(self.workers.handles):
            self.workers.reap(n, timeout=timeout)
        self.pauses.settle(self.ctl, self.recorder.db, self.log)
        if state is not None:
            self.recorder.job_state(state)
