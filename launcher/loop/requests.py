"""Admin requests (`elastic resize/preempt/suspend/resume`, dashboard buttons) read from the database, carried out by the launcher.

This is the one place where the launcher turns a queued request into a decision (grow, shrink,
preempt, suspend: `la` is the job's control loop, launcher.loop.launcher.Launcher) and answers it: every request ends `done` or `failed` with a message. Checks of
the request's shape that the CLI and dashboard share belong in the admin-request validation
they share; what is checked here is what only the running job knows (its node count, --nnodes).
"""
from __future__ import annotations

from db.requests import validate_request
from launcher.loop.autoscale import REQUESTER
from launcher.loop.outcome import Outcome


def trigger_of(la, req) -> str:
    """The migration trigger a request is recorded under: policy, dashboard, preempt or resize."""
    if req.requested_by.startswith(REQUESTER):
        return "policy"
    for row in la.db.audit_log(limit=100, target=f"job:{la.job_id}"):
        if f"request {req.id} queued" in row.result and "via CLI" not in row.result:
            return "dashboard"
        if f"request {req.id} queued" in row.result:
            break
    return "preempt" if req.action == "preempt" else "resize"


def carry_out(la, req, trigger: str) -> Outcome:
    """Decide what the request asks of the running job and do it (after the shared validation,
    db.requests, on the nodes the launcher really holds: a request queued before a change may no
    longer fit)."""
    try:
        validate_request(la.db.get_job(la.job_id), list(la.active), (), req.action, req.params)
    except ValueError as exc:
        return Outcome(trigger, False, str(exc))
    active, opts = len(la.active), la.opts
    if req.action in ("grow", "shrink"):
        n = int(req.params.get("nodes", 0))
        if n == active or not 1 <= n:
            return Outcome(trigger, False, f"already on {active} nodes")
        if n < opts.min_nodes or n > opts.max_nodes:
            return Outcome(trigger, False, f"{n} nodes is outside --nnodes {opts.min_nodes}:{opts.max_nodes}")
        return la.grow_to(n, trigger) if n > active else la.shrink_to(n, trigger)
    if req.action == "preempt":
        if "nodes" in req.params:
            return la.preempt(list(req.params["nodes"]), trigger)
        return la.shrink_to(active - int(req.params.get("count", 1)), trigger)
    if req.action == "suspend":
        return la.suspend(trigger)
    if req.action == "resume":
        return Outcome(trigger, False, "the job is running; resume applies to a suspended job")
    return Outcome(trigger, False, f"{req.action} is not supported by this launcher version")


def handle_request(la, req) -> None:
    """Carry out one pending request and record its answer."""
    trigger = trigger_of(la, req)
    la.log(f"request {req.id}: {req.action} {req.params} ({trigger})")
    out = carry_out(la, req, trigger)
    if trigger == "policy" and out.migration_id is not None:  # why the policy asked (launcher.loop.autoscale)
        la.db.add_migration_notes(out.migration_id, [req.requested_by])
    la.db.complete_request(req.id, "done" if out.ok else "failed", out.message)
