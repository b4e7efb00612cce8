"""Admin actions: POST /jobs/<id>/preempt|shrink|grow|suspend|resume.

An action never changes the job itself: it validates the form, queues a request with
Store.add_request (the launcher carries it out), writes an audit row, and tells htmx to
refresh every panel (HX-Trigger: elastic-refresh).
"""
from __future__ import annotations

from typing import Any

from flask import Blueprint, Flask, abort, flash, g, make_response, redirect, render_template, request, url_for

from dashboard.auth import admin_required, audit
from dashboard.deps import is_htmx, store
from db.records import Job
from db.vocab import REQUEST_ACTIONS

bp = Blueprint("actions", __name__)
REFRESH_EVENT = "elastic-refresh"


def _held_nodes(job_id: int) -> list[str]:
    current = store().current_rank_map(job_id)
    return list(dict.fromkeys(e.node for e in current.entries)) if current else []


def _int_field(name: str, lo: int, hi: int) -> int:
    raw = request.form.get(name, "").strip()
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise ValueError(f"{name} must be a whole number in {lo}..{hi}")
    return int(raw)


def _params(action: str, job: Job) -> dict[str, Any]:
    """Validate the form for this action; ValueError says what is wrong."""
    held = _held_nodes(job.id)
    if action == "preempt":
        names = [n.strip() for n in request.form.get("nodes", "").split(",") if n.strip()]
        if names:
            bad = [n for n in names if n not in held or n == job.pinned_node]
            if bad:
                raise ValueError(f"cannot preempt {', '.join(bad)}: not held by the job, or pinned")
            return {"nodes": list(dict.fromkeys(names))}
        return {"count": _int_field("count", 1, max(len(held), 1))}
    if action in ("shrink", "grow"):
        most = -(-job.max_devices // job.gpus_per_node)
        n = _int_field("nodes", 1, most)
        if (action == "grow") != (n > len(held)) or n == len(held):
            raise ValueError(f"{action} needs a node count {'above' if action == 'grow' else 'below'} "
                             f"the {len(held)} nodes held now")
        return {"nodes": n}
    wanted_state = "running" if action == "suspend" else "suspended"
    if job.state != wanted_state:
        raise ValueError(f"cannot {action} a {job.state} job")
    return {}


@bp.post("/jobs/<int:job_id>/<action>")
@admin_required
def act(job_id: int, action: str) -> Any:
    target = f"job:{job_id}"
    if action not in REQUEST_ACTIONS:
        audit(action, target, "denied: no such action (404)")
        abort(404, description=f"no action {action[:40]!r}: expected one of {', '.join(REQUEST_ACTIONS)}")
    job = store().get_job(job_id)
    if job is None:
        audit(action, target, "denied: no such job (404)")
        abort(404, description=f"no job {job_id}")
    try:
        params = _params(action, job)
    except ValueError as exc:
        audit(action, target, f"rejected: {exc}")
        abort(400, description=str(exc))
    rid = store().add_request(job_id, action, params, g.user.name)
    audit(action, target, f"request {rid} queued: {params}")
    message = f"Request #{rid} queued: {action} {params or ''} — the launcher will carry it out."
    if not is_htmx():
        flash(message)
        return redirect(url_for("views.job", job_id=job_id))
    resp = make_response(render_template("_action_result.html", message=message, rid=rid))
    resp.headers["HX-Trigger"] = REFRESH_EVENT
    return resp


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
