"""The one admin-request validation (db.requests): each rule, and the same answer from every door."""
from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import pytest

from db import Store
from db.records import AdminRequest, Job
from db.requests import validate_request
from launcher.cli import main
from tests.db.backends import both_backends
from tests.db.seed import layout_entries

T = datetime(2024, 1, 1, tzinfo=timezone.utc)
JOB = Job(7, "gpt", None, "running", "pp2tp2dp2", 4, "n0", 16, "standard", T, T, min_nodes=2)
HELD = ["n1", "n2", "n3"]


def pending(action: str, params: dict[str, Any]) -> AdminRequest:
    return AdminRequest(41, 7, action, params, "ops", "pending", None, T, None)


@pytest.mark.parametrize("action, raw, params", [
    ("preempt", {"nodes": "n2, n2"}, {"nodes": ["n2"]}),
    ("preempt", {"nodes": ["n3"]}, {"nodes": ["n3"]}),
    ("preempt", {"count": "1"}, {"count": 1}),
    ("shrink", {"nodes": 2}, {"nodes": 2}),
    ("grow", {"nodes": "4"}, {"nodes": 4}),
    ("suspend", {"ignored": "x"}, {}),
])
def test_valid_requests_are_normalised(action: str, raw: dict[str, Any], params: dict[str, Any]) -> None:
    assert validate_request(JOB, HELD, [], action, raw) == params


@pytest.mark.parametrize("job, action, raw, message", [
    (replace(JOB, state="finished"), "preempt", {"count": 1}, "is finished, not running"),
    (replace(JOB, state="failed"), "suspend", {}, "is failed, not running"),
    (JOB, "resume", {}, "is running, not suspended"),
    (JOB, "preempt", {"nodes": "n1,n2,n3"}, "every node the job holds"),
    (JOB, "preempt", {"nodes": "n1,n2"}, "needs at least 2 (MIN)"),
    (JOB, "preempt", {"count": 2}, "count must be 1..1"),
    (replace(JOB, min_nodes=3), "preempt", {"count": 1}, "none can go"),
    (JOB, "preempt", {"nodes": "n0"}, "does not hold n0"),
    (replace(JOB, pinned_node="n1"), "preempt", {"nodes": "n1"}, "pinned node"),
    (JOB, "preempt", {}, "nodes (e.g. n3,n4) or a count"),
    (JOB, "preempt", {"count": "\u0661"}, "whole number"),
    (JOB, "shrink", {"nodes": 1}, "below job gpt's MIN of 2"),
    (JOB, "shrink", {"nodes": 3}, "already runs on 3"),
    (JOB, "shrink", {"nodes": 4}, "shrink needs a node count below"),
    (JOB, "grow", {"nodes": 5}, "at most 4 nodes"),
    (JOB, "grow", {"nodes": "abc"}, "whole number"),
    (JOB, "explode", {}, "unknown action"),
])
def test_refusals(job: Job, action: str, raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        validate_request(job, HELD, [], action, raw)


@pytest.mark.parametrize("action, raw", [("grow", {"nodes": 1}), ("shrink", {"nodes": 1}), ("preempt", {"count": 1})])
def test_a_job_with_no_recorded_placement_yet_is_refused(action: str, raw: dict[str, Any]) -> None:
    """Until its first world is recorded a job holds no nodes as far as anyone can see: a resize would be
    judged against zero nodes (a shrink to 1 taken for a grow), so it is refused with what to do."""
    with pytest.raises(ValueError, match="has not recorded the nodes it runs on yet"):
        validate_request(replace(JOB, min_nodes=1), [], [], action, raw)


@both_backends
def test_grow_on_uneven_nodes_goes_up_to_the_recorded_max_nodes(store: Store) -> None:
    """4,4,2,2 nodes hold 12 devices, 4 on the largest: the old max_devices / gpus_per_node said 3 nodes,
    refusing a grow back to 4 after a shrink. The launcher's --nnodes MAX is what counts (v9)."""
    from db.requests import check_request
    from tests.db.seed import HET_NODES, uneven_entries

    job = store.create_job("het", "pp1tp2dp6", 4, 12, pinned_node="a1", nodes=[n for n, _, _ in HET_NODES],
                           node_gpus={n: g for n, g, _ in HET_NODES}, max_nodes=4)
    store.record_rank_map(job, 0, "pp1tp2dp4", uneven_entries(1, 2, 4)[:8])  # shrunk to a1, a2
    assert check_request(store, store.get_job(job), "grow", {"nodes": 4}) == {"nodes": 4}
    with pytest.raises(ValueError, match=r"at most 4 nodes \(its --nnodes MAX\)"):
        check_request(store, store.get_job(job), "grow", {"nodes": 5})
    assert validate_request(replace(JOB, max_nodes=6), HELD, [], "grow", {"nodes": 6}) == {"nodes": 6}


def test_identical_pending_request_is_a_duplicate() -> None:
    with pytest.raises(ValueError, match="#41 .* already pending"):
        validate_request(JOB, HELD, [pending("shrink", {"nodes": 2})], "shrink", {"nodes": "2"})
    assert validate_request(JOB, HELD, [pending("shrink", {"nodes": 2})], "preempt", {"count": 1}) == {"count": 1}


# ---------------------------------------------------------- every door gives the same answer
@pytest.fixture
def doors(url: str) -> dict[str, Any]:
    """The seeded database with two more jobs: 'two' on 2 nodes with MIN 1, 'done' finished."""
    store = Store(url)
    two = store.create_job("two", "pp1tp1dp2", 1, 4)
    store.record_rank_map(two, 0, "pp1tp1dp2", layout_entries(1, 1, 2, ["a1", "a2"], 1))
    done = store.create_job("done", "pp1tp1dp1", 1, 1)
    store.set_job_state(done, "finished")
    store.add_user("root", "root-password", "admin")
    store.close()
    return {"two": two, "done": done}


CASES = [  # (job, action, CLI args, dashboard form)
    ("done", "preempt", ["--count", "1"], {"count": "1"}),
    ("two", "preempt", ["--count", "2"], {"count": "2"}),
    ("two", "preempt", ["--nodes", "a1,a2"], {"nodes": "a1,a2"}),
    ("two", "shrink", ["--nodes", "0"], {"nodes": "0"}),
]


@both_backends
@pytest.mark.parametrize("job, action, argv, form", CASES)
def test_cli_and_dashboard_refuse_alike(url: str, doors: dict[str, Any], job: str, action: str, argv: list[str],
                                        form: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    from dashboard import create_app
    from tests.dashboard.conftest import SECRET, csrf_of

    command = "resize" if action == "shrink" else action
    assert main([command, job, *argv, "--db", url]) == 2
    assert "error" in capsys.readouterr().err
    app = create_app({"DB_URL": url, "SECRET_KEY": SECRET, "TESTING": True})
    client = app.test_client()
    token = csrf_of(client.get("/login").text)
    assert client.post("/login", data={"username": "root", "password": "root-password", "csrf_token": token}).status_code == 302
    assert client.post(f"/jobs/{doors[job]}/{action}", data={**form, "csrf_token": token}).status_code == 400
    store = app.extensions["elastic_store"]
    assert store.list_requests() == []


@both_backends
def test_fifty_identical_shrinks_queue_one(url: str, doors: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    codes = [main(["resize", "two", "--nodes", "1", "--db", url]) for _ in range(50)]
    assert codes.count(0) == 1 and codes.count(2) == 49
    assert "already pending" in capsys.readouterr().err
