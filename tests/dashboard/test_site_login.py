"""The dashboard logs people in with the cluster's own accounts (PAM, the host's real pam_unix, real Unix users
from scripts/install-test-users.sh) and lets each act on the jobs they own: its owner may shrink, grow, suspend
and switch the policy of a job; members of the operators group (admins) act on every job and alone preempt; a
denial is audited with the logged-in user. The oracle is the database: which requests were queued, by whom."""
from __future__ import annotations

import json
import pwd
import re
import threading
import time

import pytest

from dashboard import create_app
from db import Store
from tests.dashboard.conftest import SECRET, csrf_of

USERS = ("elastic-alice", "elastic-bob", "elastic-ops")


def password(user: str) -> str:
    return f"elastic-test-pw-{user}"


@pytest.fixture
def site(tmp_path):
    for user in USERS:
        try:
            pwd.getpwnam(user)
        except KeyError:
            pytest.fail(f"no Unix user {user}: run scripts/install-test-users.sh (make test does)")
    url = f"sqlite:///{tmp_path}/e.db"
    store = Store(url)
    jobs = {}
    for owner in ("elastic-alice", "elastic-bob"):
        jobs[owner] = store.create_job(f"{owner}-train", "pp1tp1dp2", 1, 2, nodes=["n1", "n2"], owner=owner)
        store.record_rank_map(jobs[owner], 0, "pp1tp1dp2", [
            {"virtual_rank": r, "node": f"n{r + 1}", "gpu": 0, "pp": 0, "dp": r, "tp": 0} for r in range(2)])
    app = create_app({"DB_URL": url, "SECRET_KEY": SECRET, "TESTING": True, "LOGIN": "pam",
                      "OPERATORS_GROUP": "elastic-operators", "CLUSTER_SOURCE": "local"})
    yield app, store, jobs
    store.close()


def logged_in(app, user: str, pw: str | None = None):
    client = app.test_client()
    token = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/login").text).group(1)
    resp = client.post("/login", data={"username": user, "password": pw or password(user), "csrf_token": token})
    if resp.status_code == 302:
        client.csrf = csrf_of(client.get("/").text)
    return client, resp


def act(client, job_id: int, action: str, **form) -> int:
    return client.post(f"/jobs/{job_id}/{action}", data={**form, "csrf_token": client.csrf}).status_code


def test_pam_login_with_the_clusters_accounts(site):
    app, store, _ = site
    _, resp = logged_in(app, "elastic-alice", "not her password")
    assert resp.status_code == 401
    alice, resp = logged_in(app, "elastic-alice")
    assert resp.status_code == 302 and alice.get("/").status_code == 200
    assert store.get_user("elastic-alice").role == "viewer" and store.get_user("elastic-ops").role == "admin" \
        if logged_in(app, "elastic-ops")[1].status_code == 302 else False
    assert store.verify_user("elastic-alice", "") is None  # the row made at login has no local password


def test_owners_act_on_their_jobs_operators_on_all(site):
    app, store, jobs = site
    alice, _ = logged_in(app, "elastic-alice")
    assert act(alice, jobs["elastic-alice"], "shrink", nodes="1") == 302  # queued: back to the job page
    assert act(alice, jobs["elastic-bob"], "shrink", nodes="1") == 403
    assert act(alice, jobs["elastic-alice"], "preempt", count="1") == 403
    assert "Preempt" not in alice.get(f"/jobs/{jobs['elastic-alice']}").text
    assert "Shrink" in alice.get(f"/jobs/{jobs['elastic-alice']}").text
    assert "Shrink" not in alice.get(f"/jobs/{jobs['elastic-bob']}").text
    ops, _ = logged_in(app, "elastic-ops")
    assert act(ops, jobs["elastic-bob"], "preempt", count="1") == 302
    queued = {(r.job_id, r.action, r.requested_by) for r in store.list_requests(limit=50)}
    assert queued == {(jobs["elastic-alice"], "shrink", "elastic-alice"), (jobs["elastic-bob"], "preempt", "elastic-ops")}
    denied = [r for r in store.audit_log(limit=50) if r.result.startswith("denied")]
    assert {(r.who, r.target) for r in denied} == {("elastic-alice", f"job:{jobs['elastic-bob']}"),
                                                   ("elastic-alice", f"job:{jobs['elastic-alice']}")}
    assert any("belongs to elastic-bob" in r.result for r in denied)


def test_private_jobs_hide_other_users_jobs_but_not_from_operators(site, tmp_path):
    app, store, jobs = site
    app.config["PRIVATE_JOBS"] = True
    alice, _ = logged_in(app, "elastic-alice")
    listing = alice.get("/").text
    assert "elastic-alice-train" in listing and "elastic-bob-train" not in listing
    assert alice.get(f"/jobs/{jobs['elastic-bob']}").status_code == 404
    assert act(alice, jobs["elastic-bob"], "shrink", nodes="1") == 404
    ops, _ = logged_in(app, "elastic-ops")
    assert "elastic-bob-train" in ops.get("/").text and ops.get(f"/jobs/{jobs['elastic-bob']}").status_code == 200
    app.config["PRIVATE_JOBS"] = False
    assert "elastic-bob-train" in alice.get("/").text


def test_private_jobs_leave_other_users_gpus_on_the_cluster_grid_and_job_pages_unnamed(site):
    """Alice's and Bob's jobs share node n5, a GPU each: with private jobs Alice's /cluster shows Bob's GPU as in
    use, with nothing of his job (id, name, layout, policy), and her job page does not name his job; an
    operator sees both."""
    app, store, _ = site
    app.config["PRIVATE_JOBS"] = True
    shared = {}
    for gpu, owner in enumerate(("elastic-alice", "elastic-bob")):
        shared[owner] = store.create_job(f"{owner}-n5", "pp1tp1dp1", 2, 1, nodes=["n5"], owner=owner)
        store.record_rank_map(shared[owner], 0, "pp1tp1dp1",
                              [{"virtual_rank": 0, "node": "n5", "gpu": gpu, "pp": 0, "dp": 0, "tp": 0}])
    alice, _ = logged_in(app, "elastic-alice")
    grid = alice.get("/cluster").text
    assert "elastic-alice-n5" in grid and "elastic-bob" not in grid, grid
    assert grid.count('data-kind="other"') == 3  # Bob's GPU on n5 and his first job's on n1 and n2
    page = alice.get(f"/jobs/{shared['elastic-alice']}").text
    assert "another user&#39;s job" in page and "elastic-bob" not in page
    ops, _ = logged_in(app, "elastic-ops")
    grid = ops.get("/cluster").text
    assert "elastic-bob-n5" in grid and 'data-kind="other"' not in grid
    assert "elastic-bob-n5" in ops.get(f"/jobs/{shared['elastic-alice']}").text


def test_a_trusted_proxys_user_header_only_from_the_proxy(site):
    app, store, jobs = site
    app.config.update(LOGIN="proxy", PROXY_ADDRESSES=["10.0.0.5"])
    client = app.test_client()
    from_proxy = {"REMOTE_ADDR": "10.0.0.5"}
    page = client.get("/", headers={"X-Remote-User": "elastic-alice"}, environ_base=from_proxy)
    assert page.status_code == 200 and "elastic-alice-train" in page.text
    forged = client.get("/", headers={"X-Remote-User": "elastic-ops"}, environ_base={"REMOTE_ADDR": "10.0.0.9"})
    assert forged.status_code == 302 and "/login" in forged.headers["Location"]
    assert any(r.who == "elastic-ops" and "not a configured proxy address" in r.result for r in store.audit_log())
    token = re.search(r'name="csrf_token" value="([^"]+)"', client.get(
        f"/jobs/{jobs['elastic-bob']}", headers={"X-Remote-User": "elastic-alice"}, environ_base=from_proxy).text)
    resp = client.post(f"/jobs/{jobs['elastic-bob']}/shrink", data={"nodes": "1", "csrf_token": token.group(1)},
                       headers={"X-Remote-User": "elastic-alice"}, environ_base=from_proxy)
    assert resp.status_code == 403 and store.pending_requests(jobs["elastic-bob"]) == []


def test_private_jobs_keep_other_users_live_events_out_of_the_stream(site):
    app, store, jobs = site
    app.config.update(PRIVATE_JOBS=True, SSE_MAX_SECONDS=2.5)
    alice, _ = logged_in(app, "elastic-alice")
    stream = alice.get("/events", buffered=False)

    def migrate_both() -> None:
        time.sleep(0.8)  # after the feed's first look, its baseline
        for owner in ("elastic-bob", "elastic-alice"):
            store.start_migration(jobs[owner], "pp1tp1dp2", "pp1tp1dp1", "resize", {}, {})

    threading.Thread(target=migrate_both, daemon=True).start()
    text = b"".join(stream.response).decode()
    stream.close()
    seen = [json.loads(line[6:])["job_id"] for line in text.splitlines() if line.startswith("data: {")]
    assert seen == [jobs["elastic-alice"]], text
