"""The job's resize policy in the running launcher: look at the cluster, let the policy decide, ask.

The policy is the job's record in the database (`elastic-launch --policy` sets it; an admin switches it from
the dashboard), read at every look, so a switch takes effect within a look. On `opportunistic`, every
--policy-watch seconds (WATCH_S by default) the backend reads the job's partition (its idle nodes, the jobs
pending there, the other elastic jobs) and launcher.policy.opportunistic decides. A decision becomes a grow or
shrink request from "policy: <why>", taken by the launcher's next poll like an admin's: validated against what
the job holds then, carried out, recorded under the trigger `policy` with the reason as the migration's note
(launcher.loop.requests), and in the audit log. Nothing is asked while any request is pending (an admin's, or the policy's own last one). What
each look saw and decided is written to the job's record (the dashboard's /cluster shows it), and the job's
policy is told to Slurm, where the other elastic jobs' policies read it (launcher.policy.peers).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict

from launcher.policy.opportunistic import ClusterView, Decision, OpportunisticPolicy
from launcher.policy.peers import policy_mark

WATCH_S = 30.0  # how often the cluster is read, unless --policy-watch says otherwise (Slurm's backfill interval)
REQUESTER = "policy"  # requested_by starts with it: launcher.loop.requests records trigger `policy`


class PolicyLoop:
    """`recorder`: the job's (launcher.loop.recorder.Recorder: its db, job_id -- known once the job is
    recorded -- and audit), read at each tick."""

    def __init__(self, opts, backend, recorder, log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.opts, self.backend, self.recorder, self.log, self.clock = opts, backend, recorder, log, clock
        self.me = getattr(backend, "job_id", 0) or 0  # the Slurm job's id: how the other elastic jobs know it
        self.policy = self._fresh_policy()
        self.watched = float("-inf")
        self.recorded = False  # --policy written to the job's record
        self.running: str | None = None  # the policy in force (told to Slurm), None before the first look

    def _fresh_policy(self) -> OpportunisticPolicy:
        o = self.opts
        return OpportunisticPolicy(o.min_nodes, o.max_nodes, o.policy_idle, o.policy_dwell, o.policy_max_per_hour,
                                   self.clock, me=self.me)

    def tick(self, held: int) -> None:
        """One look, at most every --policy-watch seconds. A failure here is said and the job goes on: the policy
        is not worth the job."""
        now = self.clock()
        if now - self.watched < self.opts.policy_watch or self.recorder.job_id is None:
            return
        self.watched = now
        try:
            if self._in_force() == "opportunistic":
                self._look(held)
        except Exception as exc:  # noqa: BLE001 -- said; the next look tries again
            self.log(f"policy: looking at the cluster failed ({type(exc).__name__}: {exc}); training goes on")

    def _in_force(self) -> str:
        """The job's policy now (its record), told to Slurm and said when it changed."""
        db, job_id = self.recorder.db, self.recorder.job_id
        if not self.recorded:
            self.recorded = True
            db.set_policy(job_id, self.opts.policy)
        policy = db.get_job(job_id).policy
        if policy != self.running:
            if self.running is not None:
                self.log(f"policy: now {policy} (switched on the job's record, was {self.running})")
            if self.running is not None or policy != "manual":  # a job started manual need not say so
                self._announce(policy)
            self.running = policy
            self.policy = self._fresh_policy()  # idle times and resize counts start again
        return policy

    def _announce(self, policy: str) -> None:
        try:
            self.backend.announce(policy_mark(policy, self.opts.min_nodes, self.opts.max_nodes))
        except Exception as exc:  # noqa: BLE001 -- said; the policy still runs, the others just do not count it
            self.log(f"policy: could not mark the job for other elastic jobs' policies ({exc}); "
                     "they will not count it when they share idle nodes or a yield")

    def _look(self, held: int) -> None:
        db, job_id = self.recorder.db, self.recorder.job_id
        if db.pending_requests(job_id):
            return
        view = self.backend.cluster_view()
        decision = self.policy.decide(held, view) if view is not None else None
        db.record_policy_watch(job_id, watch_record(view, held, decision))
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


def watch_record(view: ClusterView | None, held: int, decision: Decision | None) -> dict:
    """One look as plain JSON for the job's record: what the dashboard's /cluster shows."""
    if view is None:
        return {"held": held, "idle": [], "pending": [], "peers": [], "decision": None, "error": "no cluster view"}
    return {"held": held, "idle": list(view.idle), "pending": [asdict(p) for p in view.pending],
            "peers": [asdict(p) for p in view.peers],
            "decision": None if decision is None else {"nodes": decision.nodes, "reason": decision.reason}}
