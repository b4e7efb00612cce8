"""`--policy opportunistic` in the running launcher: look at the cluster, let the policy decide, ask.

Every WATCH_S the backend reads the job's partition (its idle nodes, the jobs pending there) and
launcher.policy.opportunistic decides. A decision becomes a grow or shrink request from "policy: <why>",
taken by the launcher's next poll like an admin's: validated against what the job holds then, carried out,
recorded under the trigger `policy` with the reason as the migration's note (launcher.loop.requests), and in
the audit log. Nothing is asked while any request is pending (an admin's, or the policy's own last one).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from launcher.policy.opportunistic import OpportunisticPolicy
from launcher.policy.peers import policy_mark

WATCH_S = 5.0  # how often the cluster is read
REQUESTER = "policy"  # requested_by starts with it: launcher.loop.requests records trigger `policy`


class PolicyLoop:
    """`recorder`: the job's (launcher.loop.recorder.Recorder: its db, job_id -- known once the job is
    recorded -- and audit), read at each tick."""

    def __init__(self, opts, backend, recorder, log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend, self.recorder, self.log, self.clock = backend, recorder, log, clock
        self.policy = OpportunisticPolicy(opts.min_nodes, opts.max_nodes, opts.policy_idle, opts.policy_dwell,
                                          opts.policy_max_per_hour, clock, me=getattr(backend, "job_id", 0) or 0)
        self.watched = float("-inf")
        self.announced = False

    def tick(self, held: int) -> None:
        """One look, at most every WATCH_S. A failure here is said and the job goes on: the policy is not
        worth the job."""
        now = self.clock()
        if now - self.watched < WATCH_S or self.recorder.job_id is None:
            return
        self.watched = now
        try:
            self._look(held)
        except Exception as exc:  # noqa: BLE001 -- said; the next look tries again
            self.log(f"policy: looking at the cluster failed ({type(exc).__name__}: {exc}); training goes on")

    def _look(self, held: int) -> None:
        if not self.announced:  # the other elastic jobs' policies count this one in (launcher.policy.peers)
            self.announced = True
            try:
                self.backend.announce(policy_mark("opportunistic", self.policy.min_nodes, self.policy.max_nodes))
            except Exception as exc:  # noqa: BLE001 -- said; the policy still runs, the others just do not count it
                self.log(f"policy: could not mark the job for other elastic jobs' policies ({exc}); "
                         "they will not count it when they share idle nodes or a yield")
        db, job_id = self.recorder.db, self.recorder.job_id
        if db.pending_requests(job_id):
            return
        view = self.backend.cluster_view()
        decision = self.policy.decide(held, view) if view is not None else None
        if decision is None or decision.nodes == held:
            return
        action = "grow" if decision.nodes > held else "shrink"
        try:
            db.queue_request(job_id, action, {"nodes": decision.nodes}, requested_by=f"{REQUESTER}: {decision.reason}")
        except ValueError as exc:
            self.log(f"policy: {action} to {decision.nodes} node(s) not asked: {exc}")
            return
        self.log(f"policy: {action} to {decision.nodes} node(s): {decision.reason}")
        self.recorder.audit("policy", f"{action} to {decision.nodes} node(s): {decision.reason}")
