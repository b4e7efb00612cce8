"""Admin actions: POST /jobs/<id>/preempt|shrink|grow|suspend|resume, and /jobs/<id>/policy.

An action never changes the job itself: it validates the form (db.requests, the same rules as the
CLI and the launcher) and queues a request in one transaction with Store.queue_request (the launcher
carries it out; two admins clicking at once cannot queue the same request twice), writes an audit
row, and tells htmx to refresh every panel (HX-Trigger: elastic-refresh). A policy switch is not a request:
it is the job's record, which the launcher reads at every look (launcher.loop.autoscale), checked by
db.requests.check_policy_switch and audited the same way.
"""
from __future__ import annotations

from typing import Any

from flask import Blueprint, Flask, abort, flash, g, make_response, redirect, render_template, request, url_for

from dashboard.auth import audit
from dashboard.deps import is_htmx, store, viewer, visible
from db.errors import NotFoundError
from db.requests import check_policy_switch
from db.vocab import REQUEST_ACTIONS
from service.authz import may_act

bp = Blueprint("actions", __name__)
REFRESH_EVENT = "elastic-refresh"


def _allowed(job: Any, action: str) -> None:
    """Its owner or an admin (the dashboard's operators) may act on a job, and only admins preempt
    (service.authz, the same rule as the service's API); a denial is audited and answered 403."""
    visible(job, f"job {job.id}")
    decision = may_act(viewer(), job, action)
    if not decision:
        audit(action, f"job:{job.id}", f"denied: {decision.why}")
        abort(403, description=decision.why)


@bp.post("/jobs/<int:job_id>/<action>")
def act(job_id: int, action: str) -> Any:
    target = f"job:{job_id}"
    if action not in REQUEST_ACTIONS:
        audit(action, target, "denied: no such action (404)")
        abort(404, description=f"no action {action[:40]!r}: expected one of {', '.join(REQUEST_ACTIONS)}")
    job = store().get_job(job_id)
    if job is None:
        audit(action, target, "denied: no such job (404)")
        abort(404, description=f"no job {job_id}")
    _allowed(job, action)
    fields = {k: request.form[k] for k in ("nodes", "count") if k in request.form}
    try:  # checked and queued in one transaction under the job's row lock (db.store_requests)
        rid, params = store().queue_request(job_id, action, fields, g.user.name)
    except ValueError as exc:
        audit(action, target, f"rejected: {exc}")
        abort(400, description=str(exc))
    except NotFoundError:  # deleted between the two reads
        audit(action, target, "denied: no such job (404)")
        abort(404, description=f"no job {job_id}")
    audit(action, target, f"request {rid} queued: {params}")
    return _answer(job_id, f"Request #{rid} queued: {action} {params or ''} — the launcher will carry it out.", rid)


@bp.post("/jobs/<int:job_id>/policy")
def switch_policy(job_id: int) -> Any:
    target = f"job:{job_id}"
    job = store().get_job(job_id)
    if job is None:
        audit("policy", target, "denied: no such job (404)")
        abort(404, description=f"no job {job_id}")
    _allowed(job, "switch the policy of")
    try:
        before = store().set_policy(job_id, check_policy_switch(job, request.form.get("policy", "")))
    except ValueError as exc:
        audit("policy", target, f"rejected: {exc}")
        abort(400, description=str(exc))
    now = request.form["policy"]
    audit("policy", target, f"switched: {before} -> {now}")
    return _answer(job_id, f"Policy of {job.name}: {before} → {now}; its launcher takes it at its next look "
                           "(within seconds).")


def _answer(job_id: int, message: str, rid: int | None = None) -> Any:
    if not is_htmx():
        flash(message)
        return redirect(url_for("views.job", job_id=job_id))
    resp = make_response(render_template("_action_result.html", message=message, rid=rid))
    resp.headers["HX-Trigger"] = REFRESH_EVENT
    return resp


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
