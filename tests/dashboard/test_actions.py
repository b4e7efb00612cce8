"""Admin actions: roles, CSRF, validation, request + audit rows, HX-Trigger refresh."""
from __future__ import annotations

from typing import Any

import pytest

from db import Store
from tests.dashboard.conftest import csrf_of
from tests.db.backends import both_backends
from tests.db.seed import spread_llama

pytestmark = both_backends  # every test here runs on SQLite and on a real PostgreSQL server


def test_admin_action_queues_request_and_audits(admin: Any, store: Store) -> None:
    spread_llama(store)
    resp = admin.post("/jobs/1/preempt", data={"count": "1", "csrf_token": admin.csrf},
                      headers={"HX-Request": "true"})
    assert resp.status_code == 200 and resp.headers["HX-Trigger"] == "elastic-refresh"
    (req,) = store.pending_requests(1)
    assert (req.action, req.params, req.requested_by) == ("preempt", {"count": 1}, "admin")
    assert f"Request #{req.id} queued" in resp.text
    audit = store.audit_log(target="job:1")[0]
    assert (audit.who, audit.action) == ("admin", "preempt") and f"request {req.id}" in audit.result
    assert store.get_job(1).state == "running"  # type: ignore[union-attr]  # the launcher acts, not the app
    assert f'data-request-id="{req.id}"' in admin.get("/jobs/1", headers={"HX-Request": "true"}).text


@pytest.mark.parametrize("action, form, params", [
    ("preempt", {"nodes": "n1"}, {"nodes": ["n1"]}),
    ("grow", {"nodes": "2"}, {"nodes": 2}),
    ("suspend", {}, {}),
])
def test_each_action_without_htmx_redirects_back(admin: Any, store: Store, action: str,
                                                 form: dict[str, str], params: dict[str, Any]) -> None:
    if action == "preempt":
        spread_llama(store)
    resp = admin.post(f"/jobs/1/{action}", data={**form, "csrf_token": admin.csrf})
    assert resp.status_code == 302 and resp.headers["Location"] == "/jobs/1"
    assert store.pending_requests(1)[-1].params == params


@pytest.mark.parametrize("action, form", [
    ("preempt", {"nodes": "n0"}),        # pinned, not held
    ("preempt", {"count": "9"}),
    ("shrink", {"nodes": "1"}),          # already on one node
    ("grow", {"nodes": "abc"}),
    ("resume", {}),                      # job is running
])
def test_invalid_action_params_are_400_and_audited(admin: Any, store: Store, action: str,
                                                   form: dict[str, str]) -> None:
    resp = admin.post(f"/jobs/1/{action}", data={**form, "csrf_token": admin.csrf})
    assert resp.status_code == 400
    assert store.pending_requests(1) == []
    assert store.audit_log(target="job:1")[0].result.startswith("rejected")


def test_unknown_action_and_job(admin: Any) -> None:
    assert admin.post("/jobs/1/explode", data={"csrf_token": admin.csrf}).status_code == 404
    assert admin.post("/jobs/99/suspend", data={"csrf_token": admin.csrf}).status_code == 404


def test_viewer_gets_403_and_is_audited(viewer: Any, store: Store) -> None:
    for action in ("preempt", "shrink", "grow", "suspend", "resume"):
        assert viewer.post(f"/jobs/1/{action}", data={"count": "1", "csrf_token": viewer.csrf}).status_code == 403
    assert store.pending_requests(1) == []
    assert store.audit_log(target="job:1")[0].result.startswith("denied")


def test_missing_or_wrong_csrf_is_400(admin: Any, store: Store) -> None:
    assert admin.post("/jobs/1/suspend").status_code == 400
    assert admin.post("/jobs/1/suspend", data={"csrf_token": "forged"}).status_code == 400
    assert admin.post("/jobs/1/suspend", headers={"X-CSRF-Token": admin.csrf}).status_code == 302
    assert admin.post("/logout").status_code == 400
    assert len(store.pending_requests(1)) == 1


def test_login_needs_csrf(anon: Any) -> None:
    anon.get("/login")
    assert anon.post("/login", data={"username": "admin", "password": "admin-password"}).status_code == 400


def test_anonymous_post_is_redirected(anon: Any, store: Store) -> None:
    token = csrf_of(anon.get("/login").text)
    resp = anon.post("/jobs/1/suspend", data={"csrf_token": token})
    assert resp.status_code == 302 and "/login" in resp.headers["Location"]
    assert store.pending_requests(1) == []


def test_logout(admin: Any) -> None:
    assert admin.post("/logout", data={"csrf_token": admin.csrf}).status_code == 302
    assert admin.get("/").status_code == 302


def test_identical_pending_request_is_refused(admin: Any, store: Store) -> None:
    assert admin.post("/jobs/1/suspend", data={"csrf_token": admin.csrf}).status_code == 302
    resp = admin.post("/jobs/1/suspend", data={"csrf_token": admin.csrf})
    assert resp.status_code == 400 and "already pending" in resp.text
    assert len(store.pending_requests(1)) == 1


def test_finished_job_gets_no_request(admin: Any, store: Store) -> None:
    store.set_job_state(2, "finished")
    for action, form in (("preempt", {"count": "1"}), ("suspend", {}), ("shrink", {"nodes": "1"})):
        resp = admin.post(f"/jobs/2/{action}", data={**form, "csrf_token": admin.csrf})
        assert resp.status_code == 400 and "is finished, not running" in resp.text
    assert store.pending_requests(2) == []


def test_admin_switches_a_jobs_policy_audited_and_the_launcher_reads_it_from_the_record(admin: Any,
                                                                                       store: Store) -> None:
    resp = admin.post("/jobs/1/policy", data={"policy": "opportunistic", "csrf_token": admin.csrf},
                      headers={"HX-Request": "true"})
    assert resp.status_code == 200 and resp.headers["HX-Trigger"] == "elastic-refresh"
    assert "Policy of llama: manual → opportunistic" in resp.text
    assert store.get_job(1).policy == "opportunistic"  # type: ignore[union-attr]
    assert store.pending_requests(1) == []  # not a request: the record itself (launcher.loop.autoscale reads it)
    audit = store.audit_log(target="job:1")[0]
    assert (audit.who, audit.action, audit.result) == ("admin", "policy", "switched: manual -> opportunistic")


@pytest.mark.parametrize("job, policy, why", [
    (2, "opportunistic", "not a Slurm job"),  # bert runs on the local backend: no queue to watch
    (1, "manual", "already runs the manual policy"),
    (1, "greedy", "unknown policy &#39;greedy&#39;"),  # (HTML-escaped on the error page)
])
def test_a_policy_switch_that_cannot_be_made_is_refused_and_audited(admin: Any, store: Store, job: int,
                                                                    policy: str, why: str) -> None:
    resp = admin.post(f"/jobs/{job}/policy", data={"policy": policy, "csrf_token": admin.csrf})
    assert resp.status_code == 400 and why in resp.text
    assert store.get_job(job).policy == "manual"  # type: ignore[union-attr]
    assert store.audit_log(target=f"job:{job}")[0].result.startswith("rejected: ")


def test_viewers_cannot_switch_a_policy(viewer: Any, store: Store) -> None:
    assert viewer.post("/jobs/1/policy", data={"policy": "opportunistic", "csrf_token": viewer.csrf}).status_code == 403
    assert store.get_job(1).policy == "manual"  # type: ignore[union-attr]
