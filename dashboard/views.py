"""Read-only pages. Each view is a few lines: fetch from the Store, render full page or,
for htmx requests, just the partial that gets swapped."""
from __future__ import annotations

import io
import json
from datetime import datetime, timezone
from typing import Any

from flask import Blueprint, Flask, Response, abort, current_app, g, render_template, request, url_for

from dashboard import charts
from dashboard.auth import audit
from dashboard.cluster_privacy import placement_for
from dashboard.deps import is_htmx, owner_shown, store, visible
from dashboard.timeline import pause_of, timeline
from db.survival import survival_of
from db.liveness import lost_since, resume_hint, shown_state
from db.exports import RANK_MAP_COLUMNS, rank_map_rows, write_csv
from db.filters import MAX_LIMIT, parse_history_filters, parse_int
from db.store import HISTORY_COLUMNS, migration_notes
from db.vocab import JOB_STATES, MAX_NAME, MIGRATION_STATUSES, MIGRATION_TRIGGERS, SLA_TIERS

bp = Blueprint("views", __name__)
#: The only query keys carried into links: never pass raw query args to url_for (`?_external=1`
#: with a forged Host would point export links off-site; `?endpoint=` raises a TypeError).
FILTER_KEYS = ("job", "since", "until", "trigger", "status")
PAGE_SIZE = 25
PP_COLOURS = ["#bfdbfe", "#bbf7d0", "#fde68a", "#fecaca", "#ddd6fe", "#a5f3fc", "#fed7aa", "#fbcfe8"]
TP_COLOURS = ["#1d4ed8", "#b91c1c", "#047857", "#7c3aed", "#c2410c", "#0e7490", "#be185d", "#4d7c0f"]


#: ?show= choices on the jobs page: every state by default (running first, then the most recent), so a job that
#: just finished is still there
JOB_VIEWS = {"all": None, "active": ("running", "suspended", "stopped"), **{st: (st,) for st in JOB_STATES}}
JOBS_PAGE_SIZE = 50
#: what a rank map's epoch is (the job page, the timeline)
EPOCH_HINT = ("each placement of the job's ranks on GPUs is an epoch, numbered from 0 where the job started; every "
              "committed migration, restart or resume starts the next one (a failed migration does not)")
#: how to create the first user (the login page when there is none; `elastic dashboard`'s start message)
ADD_USER = "elastic dashboard --add-user NAME --role admin"


@bp.get("/")
def jobs() -> str:
    """One page of jobs, running first; the same few queries for any number of jobs."""
    show = request.args.get("show", "all")
    name = request.args.get("name", "").strip()
    if show not in JOB_VIEWS:
        abort(400, description=f"bad show {show[:40]!r}: expected one of {', '.join(JOB_VIEWS)}")
    if len(name) > MAX_NAME:
        abort(400, description=f"name filter too long (max {MAX_NAME} characters)")
    try:
        page = parse_int("page", request.args.get("page", "1"), 1, 10**6)
    except ValueError as exc:
        abort(400, description=str(exc))
    rows, total = store().jobs_page(JOB_VIEWS[show], name or None, JOBS_PAGE_SIZE, (page - 1) * JOBS_PAGE_SIZE,
                                    owner=owner_shown())
    args = {k: v for k, v in (("show", show), ("name", name)) if v and (k, v) != ("show", "all")}
    ctx = {"rows": rows, "tiers": SLA_TIERS, "args": args, "page": page, "total": total, "show": show,
           "name": name, "views": JOB_VIEWS, "pages": max(1, -(-total // JOBS_PAGE_SIZE))}
    return render_template("_jobs_table.html" if is_htmx() else "jobs.html", **ctx)


def _job_panels(job_id: int) -> dict[str, Any]:
    visible(store().get_job(job_id), f"job {job_id}")
    try:
        placement = store().placement(job_id)
    except LookupError:
        abort(404, description=f"no job {job_id}")
    if (user := owner_shown()) is not None:
        placement = placement_for(placement, {j.name for j in store().list_jobs(owner=user)})
    marked, steps = store().recent_migrations(job_id, 50), store().steps(job_id)  # marked on the loss chart
    loss = [s.loss for s in steps if s.loss is not None]
    return {"p": placement, "job": placement["job"], "migrations": marked[:5],
            "t": timeline(store().rank_maps(job_id), marked, steps, datetime.now(timezone.utc),
                          href=lambda mid: url_for("views.migration", mid=mid)),
            "last_loss": loss[-1] if loss else None, "pause_of": pause_of,
            "why_failed": store().why_failed(job_id),
            "sv": survival_of(store().launch_spec(job_id)),
            "requests": store().list_requests(job_id, 8), "pp_colours": PP_COLOURS, "tp_colours": TP_COLOURS}


@bp.get("/jobs/<int:job_id>")
def job(job_id: int) -> str:
    ctx = _job_panels(job_id)
    return render_template("_job_panels.html" if is_htmx() else "job.html", **ctx)


@bp.get("/jobs/<int:job_id>/rank-maps")
def rank_maps(job_id: int) -> Response:
    """Every epoch's rank map of a job (each rank's het-job component, node, GPU, pp/dp/tp), as JSON or
    CSV: the same rows as `elastic history --rank-maps --job J`."""
    fmt = request.args.get("format", "json")
    if fmt not in ("csv", "json"):
        abort(400, description=f"bad format {fmt[:40]!r}: expected csv or json")
    visible(store().get_job(job_id), f"job {job_id}")
    rows = rank_map_rows(store().rank_maps(job_id))
    if fmt == "json":
        return Response(json.dumps(rows, indent=2), mimetype="application/json")
    return Response(_csv(rows, RANK_MAP_COLUMNS), mimetype="text/csv",
                    headers={"Content-Disposition": f"attachment; filename=job-{job_id}-rank-maps.csv"})


@bp.get("/migrations/<int:mid>")
def migration(mid: int) -> str:
    m = store().get_migration(mid) or abort(404, description=f"no migration {mid}")
    visible(store().get_job(m.job_id), f"migration {mid}")
    return render_template("migration.html", m=m, notes=migration_notes(m), phases=charts.phase_chart(m.phases),
                           bytes=charts.bytes_chart(m.bytes_moved, m.bytes_checkpoint), human_bytes=charts.human_bytes)


@bp.get("/history")
def history() -> Any:
    try:
        filters = parse_history_filters(request.args)
        page = parse_int("page", request.args.get("page", "1"), 1, 10**6)
        limit = parse_int("limit", request.args.get("limit", str(MAX_LIMIT)), 1, MAX_LIMIT)
    except ValueError as exc:
        abort(400, description=str(exc))
    fmt = request.args.get("format", "html")
    if fmt not in ("html", "csv", "json"):
        abort(400, description=f"bad format {fmt!r}: expected html, csv or json")
    if fmt != "html":  # exports: the whole filtered query (up to `limit` rows), like `elastic history`
        rows = store().history(**filters.as_kwargs(), limit=limit, owner=owner_shown())
    else:
        rows = store().history(**filters.as_kwargs(), limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE,
                               owner=owner_shown())
    if fmt == "json":
        return Response(json.dumps(rows, indent=2), mimetype="application/json")
    if fmt == "csv":
        return Response(_csv(rows, HISTORY_COLUMNS), mimetype="text/csv",
                        headers={"Content-Disposition": "attachment; filename=history.csv"})
    total = store().history_count(**filters.as_kwargs(), owner=owner_shown())
    job = request.args.get("job", "").strip()
    ctx = {"rows": rows, "page": page, "pages": max(1, -(-total // PAGE_SIZE)), "total": total,
           "unknown_job": job if not total and job and store().find_job(job) is None else None,
           "args": {k: v for k in FILTER_KEYS if (v := request.args.get(k, "").strip())},
           "triggers": MIGRATION_TRIGGERS, "statuses": MIGRATION_STATUSES}
    return render_template("_history_table.html" if is_htmx() else "history.html", **ctx)


def _csv(rows: list[dict[str, Any]], columns) -> str:
    buf = io.StringIO()
    write_csv(rows, columns, buf)
    return buf.getvalue()


def _error(exc: Any) -> tuple[str, int]:
    if exc.code == 404 and request.method == "POST" and getattr(g, "user", None) and not g.get("audited"):
        audit("post", request.path, "denied: not found (404)")  # e.g. an admin POST to a job id out of range
    template = "_error.html" if is_htmx() else "error.html"
    return render_template(template, code=exc.code, name=exc.name, description=exc.description), exc.code


def _crash(exc: Exception) -> tuple[str, int]:
    """Anything unexpected: log the traceback server-side, show the visitor one line (no internals)."""
    current_app.logger.exception("unhandled error on %s %s", request.method, request.path)
    return render_template("_error.html" if is_htmx() else "error.html", code=500, name="Internal Server Error",
                           description="the dashboard hit an unexpected error; the server log has details"), 500


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
    for code in (400, 403, 404, 405, 409, 413, 429):
        app.register_error_handler(code, _error)
    app.register_error_handler(500, _crash)
    app.jinja_env.globals.update(human_bytes=charts.human_bytes, survival_of=survival_of, shown_state=shown_state,
                                  lost_since=lost_since, resume_hint=resume_hint, epoch_hint=EPOCH_HINT,
                                  no_users=lambda: not store().list_users(), ADD_USER=ADD_USER)
