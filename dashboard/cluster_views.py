"""/cluster: every node of the partition(s) as GPUs, each with its job, cluster-wide fragmentation
and its history. Views are a few lines; the data comes from dashboard.cluster_data, the figures
from dashboard.cluster, the chart geometry from dashboard.linechart."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from flask import Blueprint, Flask, abort, current_app, g, render_template, request, url_for

from dashboard.cluster import ClusterView, ElasticJob
from dashboard.auth import admin_required
from dashboard.cluster_data import ClusterSource, elastic_jobs
from dashboard.cluster_privacy import view_for
from dashboard.deps import is_htmx, owner_shown, store, visible
from dashboard.linechart import LineChart, line_chart
from dashboard.policy_panel import opportunistic_nodes, policy_decisions, policy_rows
from dashboard.preempt_preview import preview
from dashboard.slurm_reader import SlurmReadError
from dashboard.timeline import pause_of, timeline
from db.requests import check_request

bp = Blueprint("cluster", __name__)
JOB_COLOURS = 8  # CSS classes jc0..jc7 (no inline styles: they would not survive a strict CSP)


def source() -> ClusterSource:
    return current_app.extensions["elastic_cluster"]


def _clock(x: float) -> str:
    return datetime.fromtimestamp(x, timezone.utc).strftime("%H:%M:%S")


def history_chart() -> LineChart:
    """The fragmentation index over the stored samples (0: every free GPU on a whole free node)."""
    samples = store().cluster_samples(limit=500)
    pts = [(s.at.timestamp(), s.figures.index) for s in samples]
    stranded = [(s.at.timestamp(), s.figures.stranded / s.figures.gpus_total if s.figures.gpus_total else 0.0)
                for s in samples]
    return line_chart([("fragmentation index", "#b91c1c", pts), ("stranded / all GPUs", "#1d4ed8", stranded)],
                      y_min=0.0, y_max=1.0, x_text=_clock, y_text=lambda y: f"{y:.2f}")


def job_classes(view: ClusterView) -> dict[str, str]:
    """A colour class per job key, stable in the order jobs appear on the nodes."""
    keys = list(dict.fromkeys(g.job for n in view.nodes for g in n.gpus if g.job))
    return {k: f"jc{i % JOB_COLOURS}" for i, k in enumerate(keys)}


def cluster_context() -> dict[str, Any]:
    view, warning = source().view()
    policies, user = policy_rows(store(), view), owner_shown()
    if user is not None:  # the site keeps jobs private: this user's own, and other GPUs only as taken
        own = {j.id for j in store().list_jobs(owner=user)}
        view, policies = view_for(view, user, own), [p for p in policies if p.job_id in own]
    return {"view": view, "warning": warning, "f": view.fragmentation, "history": history_chart(),
            "job_class": job_classes(view), "policies": policies, "above_min": opportunistic_nodes(policies),
            "decisions": policy_decisions(store(), user)}


@bp.get("/cluster")
def cluster() -> Any:
    try:
        ctx = cluster_context()
    except SlurmReadError as exc:  # CLUSTER_SOURCE=slurm and Slurm does not answer
        return render_template("_error.html" if is_htmx() else "error.html", code=503, name="Slurm unavailable",
                               description=f"cannot read the cluster from Slurm: {exc}"), 503
    return render_template("_cluster_panels.html" if is_htmx() else "cluster.html", **ctx)


def _refusal(job: ElasticJob, leaving: list[str]) -> str | None:
    """Why the job page's preempt of `leaving` would be refused (the one request validation), or None."""
    record = store().get_job(job.id)
    if record is None:
        return f"job {job.id} is gone"
    try:
        check_request(store(), record, "preempt", {"nodes": leaving})
    except ValueError as exc:
        return str(exc)
    return None


@bp.post("/cluster/preempt/preview")
@admin_required
def preempt_preview() -> Any:
    """Dry run: which elastic jobs would leave the picked nodes, and the plans' bytes. Confirming is
    the job page's own preempt (POST /jobs/<id>/preempt), so validation and audit are the same."""
    view, _warning = source().view()
    jobs = elastic_jobs(store())
    picked = request.form.getlist("node")
    try:
        result = preview(view, jobs, {j.id: store().launch_spec(j.id) for j in jobs}, picked, _refusal)
    except ValueError as exc:
        store().audit(g.user.name, "preempt-preview", "cluster", f"rejected: {exc}")
        abort(400, description=str(exc))
    return render_template("_preempt_preview.html", p=result)


@bp.get("/jobs/<int:job_id>/timeline")
def job_timeline(job_id: int) -> str:
    job = visible(store().get_job(job_id), f"job {job_id}")
    migrations = store().recent_migrations(job_id, limit=200)
    t = timeline(store().rank_maps(job_id), migrations, store().steps(job_id), datetime.now(timezone.utc),
                 href=lambda mid: url_for("views.migration", mid=mid))
    ctx = {"job": job, "t": t, "migrations": migrations, "pause_of": pause_of}
    return render_template("_timeline_panels.html" if is_htmx() else "timeline.html", **ctx)


def init_app(app: Flask) -> None:
    app.extensions["elastic_cluster"] = ClusterSource(app.config, app.extensions["elastic_store"])
    app.register_blueprint(bp)
