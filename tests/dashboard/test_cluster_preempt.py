"""Preempt from the cluster view: the dry run (the planner on the recorded launch spec) and its
confirm, which is the job page's own preempt request (same validation, same audit)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from flask import Flask

from dashboard import create_app
from db import Store
from tests.dashboard.conftest import PASSWORDS, SECRET, login
from tests.db.seed import layout_entries

SPEC = {"model": {"layers": 4, "hidden": 64, "vocab": 256}, "min_nodes": 1, "max_nodes": 2, "gpus_per_node": 2,
        "layouts": {"2": "pp2tp1dp1", "4": "pp2tp1dp2"}}


@pytest.fixture
def two_node_app(tmp_path: Path) -> Flask:
    """One elastic job pp2tp1dp2 on n1 (pinned) + n2, 2 GPUs each; the local backend's view."""
    url = f"sqlite:///{tmp_path / 'p.db'}"
    store = Store(url)
    job = store.create_job("big", "pp2tp1dp2", 2, 4, pinned_node="n1", nodes=["n1", "n2"])
    store.record_rank_map(job, 0, "pp2tp1dp2", layout_entries(2, 1, 2, ["n1", "n2"], 2))
    store.set_launch_spec(job, SPEC)
    for role in PASSWORDS:
        store.add_user(role, PASSWORDS[role], role)
    store.close()
    return create_app({"DB_URL": url, "SECRET_KEY": SECRET, "TESTING": True, "CLUSTER_SOURCE": "local"})


def _preview(client, nodes: list[str]):
    return client.post("/cluster/preempt/preview", data={"node": nodes, "csrf_token": client.csrf},
                       headers={"HX-Request": "true"})


def test_dry_run_shows_the_plan_and_confirm_is_the_job_pages_preempt(two_node_app: Flask) -> None:
    client = two_node_app.test_client()
    client.csrf = login(client, "admin")
    page = client.get("/cluster").text
    assert 'id="preempt-pick"' in page and 'value="n2"' in page
    resp = _preview(client, ["n2"])
    assert resp.status_code == 200, resp.text
    html = resp.text
    assert 'data-elastic-job="1" data-refused="no"' in html and "pp2tp1dp2 → pp2tp1dp1" in html
    moved = int(re.search(r'data-bytes="(\d+)"', html).group(1))
    assert moved > 0 and 'releases <span class="released">n2</span>' in html and 'class="stays"' not in html
    form = re.search(r'<form method="post" action="([^"]+)".*?name="nodes" value="([^"]+)"', html, re.S)
    assert form.groups() == ("/jobs/1/preempt", "n2")
    store: Store = two_node_app.extensions["elastic_store"]
    assert store.pending_requests(1) == []  # a dry run queues nothing
    done = client.post(form.group(1), data={"nodes": form.group(2), "csrf_token": client.csrf},
                       headers={"HX-Request": "true"})
    assert done.status_code == 200 and done.headers["HX-Trigger"] == "elastic-refresh"
    (req,) = store.pending_requests(1)
    assert (req.action, req.params, req.requested_by) == ("preempt", {"nodes": ["n2"]}, "admin")
    assert f"request {req.id} queued" in store.audit_log(target="job:1")[0].result
    # the dry run goes through the same validation as the confirm: now a duplicate of a pending request
    again = _preview(client, ["n2"]).text
    assert 'data-refused="yes"' in again and f"request #{req.id}" in again and "already pending" in again


def test_dry_run_refuses_the_batch_node_unknown_nodes_and_viewers(two_node_app: Flask) -> None:
    client = two_node_app.test_client()
    client.csrf = login(client, "admin")
    html = _preview(client, ["n1"]).text
    assert 'data-refused="yes"' in html and "n1 is the job&#39;s pinned node" in html and "Confirm" not in html
    bad = _preview(client, ["n9"])
    assert bad.status_code == 400 and "no node n9" in bad.text
    assert _preview(client, []).status_code == 400
    viewer = two_node_app.test_client()
    viewer.csrf = login(viewer, "viewer")
    assert _preview(viewer, ["n2"]).status_code == 403
    assert 'id="preempt-pick"' not in viewer.get("/cluster").text


def test_a_job_of_a_scripts_own_model_gets_its_layout_and_release_but_no_byte_count_and_can_be_confirmed(
        two_node_app: Flask) -> None:
    """A runtime-API job records a launch spec without a model (the dashboard cannot plan what it holds): the dry
    run still says the layout the job's policy takes and the node Slurm gets back, and the confirm is offered."""
    store: Store = two_node_app.extensions["elastic_store"]
    store.set_launch_spec(1, {**SPEC, "model": None})
    client = two_node_app.test_client()
    client.csrf = login(client, "admin")
    html = _preview(client, ["n2"]).text
    assert 'data-refused="no"' in html and "pp2tp1dp2 → pp2tp1dp1" in html and "no dry run of them" in html
    assert 'releases <span class="released">n2</span>' in html and "Confirm: move big off n2" in html
    assert "data-bytes" not in html
