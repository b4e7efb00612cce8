"""Store behaviour: jobs, rank maps, migrations, requests, audit, users."""
from __future__ import annotations

from datetime import timedelta

import pytest

from db import Store
from db.errors import NotFoundError
from tests.db.backends import both_backends
from tests.db.seed import T0, FakeClock, layout_entries, seed_demo, seed_hetjob

pytestmark = both_backends  # every test here runs on SQLite and on a real PostgreSQL server


def test_job_lifecycle(store: Store, clock: FakeClock) -> None:
    jid = store.create_job("gpt", "pp2tp1dp1", 4, 8, pinned_node="n0", nodes=["n1"], sla_tier="premium")
    job = store.get_job(jid)
    assert job is not None and job.name == "gpt" and job.created_at == T0 and job.pinned_node == "n0"
    assert store.find_job("gpt") == job and store.find_job(str(jid)) == job and store.find_job("nope") is None
    clock.advance(5)
    store.set_job_state(jid, "suspended")
    job = store.get_job(jid)
    assert job is not None and job.state == "suspended" and job.updated_at == T0 + timedelta(seconds=5)
    assert [j.id for j in store.list_jobs(state="suspended")] == [jid]
    nodes = {n.name: n for n in store.list_nodes(jid)}
    assert nodes["n0"].pinned and not nodes["n1"].pinned and set(nodes["n1"].devices) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="unknown job state"):
        store.set_job_state(jid, "exploded")
    with pytest.raises(ValueError):
        store.create_job("x", "pp1tp1dp1", 4, 4, sla_tier="gold")


def test_rank_maps_close_previous_epoch_and_track_devices(store: Store, clock: FakeClock) -> None:
    jid = store.create_job("gpt", "pp2tp2dp1", 2, 4, nodes=["n1", "n2"])
    store.record_rank_map(jid, 0, "pp2tp2dp1", layout_entries(2, 2, 1, ["n1", "n2"], 2))
    clock.advance(10)
    store.record_rank_map(jid, 1, "pp2tp1dp1", [e.__dict__ for e in layout_entries(2, 1, 1, ["n1"], 2)])
    maps = store.rank_maps(jid)
    assert [m.epoch for m in maps] == [0, 1]
    assert maps[0].ended_at == maps[1].started_at == T0 + timedelta(seconds=10)
    current = store.current_rank_map(jid)
    assert current is not None and current.layout == "pp2tp1dp1" and len(current.entries) == 2
    assert store.get_job(jid).layout == "pp2tp1dp1"  # type: ignore[union-attr]
    nodes = {n.name: n for n in store.list_nodes(jid)}
    assert nodes["n1"].state == "active" and nodes["n2"].state == "idle"
    assert nodes["n2"].devices == {0: "idle", 1: "idle"} and nodes["n1"].devices == {0: "used", 1: "used"}
    assert store.devices_held(jid) == 2
    with pytest.raises(ValueError, match="not after"):
        store.record_rank_map(jid, 1, "pp1tp1dp1", layout_entries(1, 1, 1, ["n1"], 2))
    with pytest.raises(ValueError, match="two ranks on one device"):
        store.record_rank_map(jid, 2, "x", [dict(virtual_rank=i, node="n1", gpu=0, pp=0, dp=0, tp=0) for i in (0, 1)])
    with pytest.raises(NotFoundError):
        store.record_rank_map(999, 0, "x", [])


def test_failed_node_marks_devices(store: Store) -> None:
    jid = store.create_job("gpt", "pp1tp2dp1", 2, 2, nodes=["n1"])
    store.set_node_state(jid, "n1", "failed")
    assert store.list_nodes(jid)[0].devices == {0: "failed", 1: "failed"}
    store.set_node_state(jid, "n9", "active")
    assert [n.name for n in store.list_nodes(jid)] == ["n1", "n9"]
    grid = store.placement(jid)["grid"]
    assert [c["kind"] for c in grid[0]["cells"]] == ["failed", "failed"]


def test_migration_round_trip(store: Store, clock: FakeClock) -> None:
    ids = seed_demo(store, clock)
    m = store.get_migration(ids["migration"])
    assert m is not None
    assert (m.status, m.trigger, m.bytes_moved, m.bytes_checkpoint, m.bit_exact) == ("succeeded", "resize", 1_000_000, 8_000_000, True)
    assert m.phases == {"plan": 0.5, "build_groups": 1.5, "execute": 6.0, "rebuild": 2.0}
    assert m.duration_s == 10.0 and m.job_name == "llama"
    assert m.plan_summary["instructions"] == {"send": 12, "recv": 12}
    assert m.fragmentation_before["occupied_devices"] == 8 and m.fragmentation_after["occupied_devices"] == 4  # type: ignore[index]
    with pytest.raises(ValueError, match="unknown phase"):
        store.finish_migration(m.id, "failed", None, None, None, {"warmup": 1.0})
    with pytest.raises(ValueError, match="unknown trigger"):
        store.start_migration(ids["llama"], "a", "b", "cosmic-ray", {}, {})
    with pytest.raises(NotFoundError):
        store.finish_migration(999, "failed", None, None, None, {})
    assert store.get_migration(999) is None


def test_migration_notes_are_appended_to_its_summary(store: Store, clock: FakeClock) -> None:
    mid = seed_demo(store, clock)["migration"]
    store.add_migration_notes(mid, ["component 1 (Slurm job 20): n4 released (scontrol update)"])
    store.add_migration_notes(mid, ["n2 stays allocated, idle"])
    m = store.get_migration(mid)
    assert m.plan_summary["notes"] == ["component 1 (Slurm job 20): n4 released (scontrol update)",
                                       "n2 stays allocated, idle"]
    assert m.plan_summary["instructions"] == {"send": 12, "recv": 12}  # the plan's summary is kept
    with pytest.raises(NotFoundError):
        store.add_migration_notes(999, ["x"])


def test_fragmentation_and_placement(store: Store, clock: FakeClock) -> None:
    ids = seed_demo(store, clock)
    p = store.placement(ids["llama"])
    rows = {r["name"]: r for r in p["grid"]}
    assert rows["n0"]["pinned"] and all(c["kind"] == "idle" for c in rows["n0"]["cells"])
    assert [c["kind"] for c in rows["n2"]["cells"]] == ["idle", "idle", "other", "other"]
    assert rows["n2"]["cells"][2]["other_job"] == "bert"
    assert [c["rank"] for c in rows["n1"]["cells"]] == [0, 1, 2, 3]
    f = p["fragmentation"]
    assert f["unreleasable"] == ["n0"]  # pinned; n2 has no llama ranks so it is releasable
    assert {n["node"]: n["releasable"] for n in f["nodes"]} == {"n1": False, "n2": True, "n0": False}
    assert f["tp_groups_spanning_nodes"] == []


def test_tp_group_spanning_nodes_is_reported(store: Store) -> None:
    jid = store.create_job("odd", "pp1tp4dp1", 2, 4)
    store.record_rank_map(jid, 0, "pp1tp4dp1", layout_entries(1, 4, 1, ["a", "b"], 2))
    f = store.fragmentation(jid)
    assert f["tp_groups_spanning_nodes"] == [{"pp": 0, "dp": 0, "nodes": ["a", "b"], "ranks": [0, 1, 2, 3]}]


def test_requests_audit_users(store: Store) -> None:
    jid = store.create_job("gpt", "pp1tp1dp1", 1, 1)
    rid = store.add_request(jid, "preempt", {"nodes": ["n3"]}, "alice")
    assert [r.id for r in store.pending_requests(jid)] == [rid]
    store.complete_request(rid, "done", "released n3")
    assert store.pending_requests(jid) == []
    r = store.get_request(rid)
    assert r is not None and r.status == "done" and r.message == "released n3" and r.params == {"nodes": ["n3"]}
    with pytest.raises(NotFoundError):
        store.add_request(999, "grow", {}, "alice")
    with pytest.raises(ValueError):
        store.add_request(jid, "explode", {}, "alice")
    aid = store.audit("alice", "preempt", f"job:{jid}", "ok")
    assert store.audit_log()[0].id == aid
    store.add_user("alice", "s3cret-pw", "admin")
    assert store.verify_user("alice", "s3cret-pw").is_admin  # type: ignore[union-attr]
    assert store.verify_user("alice", "wrong") is None and store.verify_user("bob", "x") is None
    with pytest.raises(ValueError, match="exists"):
        store.add_user("alice", "other-pw", "viewer")
    store.add_user("alice", "other-pw", "viewer", replace=True)
    assert store.verify_user("alice", "other-pw").role == "viewer"  # type: ignore[union-attr]


def test_password_is_hashed(store: Store, store_url: str) -> None:
    from sqlalchemy import create_engine, text

    store.add_user("carol", "plain-text-pw", "viewer")
    engine = create_engine(store_url)  # read the table directly, not through the Store
    with engine.connect() as conn:
        (stored,) = conn.execute(text("SELECT password_hash FROM users")).one()
    engine.dispose()
    assert "plain-text-pw" not in stored and stored.startswith(("scrypt:", "pbkdf2:"))


def test_each_state_change_is_one_transaction(store: Store) -> None:
    """A failing write leaves nothing behind (the job row insert is rolled back with it)."""
    jid = store.create_job("gpt", "pp1tp1dp1", 1, 1)
    before = store.current_rank_map(jid)
    with pytest.raises(ValueError):
        store.record_rank_map(jid, 0, "x", [dict(virtual_rank=0, node="n", gpu=0, pp=0, dp=0, tp=0),
                                            dict(virtual_rank=0, node="n", gpu=1, pp=0, dp=0, tp=0)])
    assert store.current_rank_map(jid) == before is None


def test_update_job(store: Store) -> None:
    jid = store.create_job("gpt", "pp1tp1dp1", 1, 1)
    store.update_job(jid, slurm_job_id="4242", sla_tier="premium")
    job = store.get_job(jid)
    assert job is not None and job.slurm_job_id == "4242" and job.sla_tier == "premium" and job.max_devices == 1
    with pytest.raises(NotFoundError):
        store.update_job(999, slurm_job_id="1")


def test_heterogeneous_job_on_uneven_nodes_round_trip(store: Store) -> None:
    """Rank maps keep each rank's component; nodes keep their GPU count and component; the grid draws
    one cell per GPU a node has and counts idle GPUs by the node's own size."""
    jid = seed_hetjob(store, layout=(1, 2, 5))  # 10 ranks on 4+4+2+2 GPUs: b2 stays idle
    ranks = store.current_rank_map(jid).entries  # type: ignore[union-attr]
    assert [(e.node, e.component) for e in ranks] == [("a1", 0)] * 4 + [("a2", 0)] * 4 + [("b1", 1)] * 2
    nodes = {n.name: (n.gpus, n.component, len(n.devices)) for n in store.list_nodes(jid)}
    assert nodes == {"a1": (4, 0, 4), "a2": (4, 0, 4), "b1": (2, 1, 2), "b2": (2, 1, 2)}
    p = store.placement(jid)
    assert [(r["name"], len(r["cells"]), r["component"]) for r in p["grid"]] == [
        ("a1", 4, 0), ("a2", 4, 0), ("b1", 2, 1), ("b2", 2, 1)]
    assert {r["node"]: r["idle"] for r in p["fragmentation"]["nodes"]} == {"a1": 0, "a2": 0, "b1": 0, "b2": 2}
    assert p["fragmentation"]["idle_devices"] == 2
    # the next epoch keeps the components (dict rows as the launcher writes them)
    store.record_rank_map(jid, 1, "pp1tp2dp4", [{**e.__dict__} for e in ranks[:8]])
    assert {e.component for e in store.current_rank_map(jid).entries} == {0}  # type: ignore[union-attr]


def test_bad_components_and_node_sizes_are_refused(store: Store) -> None:
    jid = store.create_job("het", "pp1tp1dp2", 2, 4, nodes=["n1"])
    two = [dict(virtual_rank=i, node="n1", gpu=i, pp=0, dp=i, tp=0, component=i) for i in (0, 1)]
    with pytest.raises(ValueError, match="one node in two components"):
        store.record_rank_map(jid, 0, "pp1tp1dp2", two)
    with pytest.raises(ValueError, match="component is a number from 0"):
        store.record_rank_map(jid, 0, "pp1tp1dp1", [dict(virtual_rank=0, node="n1", gpu=0, pp=0, dp=0, tp=0,
                                                         component=-1)])
    with pytest.raises(ValueError, match="GPU count must be a positive number"):
        store.set_node_state(jid, "n2", "idle", gpus=0)
    with pytest.raises(ValueError, match="n3: a heterogeneous-job component"):
        store.create_job("x", "pp1tp1dp1", 2, 2, nodes=["n3"], components={"n3": -2})


def test_node_size_learnt_later_resizes_its_devices(store: Store) -> None:
    """A node a grow acquired is recorded with its own GPU count and component (set_node_state)."""
    jid = store.create_job("het", "pp1tp1dp4", 4, 8, nodes=["a1"])
    store.set_node_state(jid, "b1", "idle", gpus=2, component=1)
    store.set_node_state(jid, "a1", "active", gpus=2)
    nodes = {n.name: (n.gpus, n.component, sorted(n.devices)) for n in store.list_nodes(jid)}
    assert nodes == {"a1": (2, 0, [0, 1]), "b1": (2, 1, [0, 1])}


def test_jobs_page_name_filter_ignores_case_and_wildcards(store: Store) -> None:
    """The same answer on SQLite (LIKE ignores case) and PostgreSQL (it does not: ILIKE)."""
    for name in ("GPT-big", "gpt_small", "llama", "gptXsmall"):
        store.create_job(name, "pp1tp1dp1", 1, 1)
    rows, total = store.jobs_page(name="gpt")
    assert total == 3 and sorted(r["job"].name for r in rows) == ["GPT-big", "gptXsmall", "gpt_small"]
    rows, total = store.jobs_page(name="T_S")  # _ is a character here, not a wildcard
    assert total == 1 and rows[0]["job"].name == "gpt_small"


def test_names_too_long_for_the_columns_are_refused_alike(store: Store) -> None:
    """PostgreSQL enforces VARCHAR(200) and SQLite does not: the store refuses both the same way."""
    with pytest.raises(ValueError, match="job name has 1 to 200 characters, not 201"):
        store.create_job("j" * 201, "pp1tp1dp1", 1, 1)
    with pytest.raises(ValueError, match="node name"):
        store.create_job("j", "pp1tp1dp1", 1, 1, nodes=["n" * 300])
    assert store.list_jobs() == []
    assert store.get_job(store.create_job("j" * 200, "pp1tp1dp1", 1, 1)).name == "j" * 200  # type: ignore[union-attr]
