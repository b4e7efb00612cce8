"""Launch specs, reported steps, fragmentation samples and change marks (db.store_cluster)."""
from __future__ import annotations

from datetime import timedelta

import pytest

from db import Store
from db.errors import NotFoundError
from db.records import ClusterSample, Fragmentation
from tests.db.seed import T0, FakeClock, layout_entries


def test_launch_spec_round_trips_and_unknown_job_is_refused(tmp_path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'x.db'}")
    job = store.create_job("j", "pp2tp1dp1", 2, 4)
    spec = {"model": {"layers": 4, "hidden": 64}, "min_nodes": 1, "max_nodes": 2, "layouts": {"2": "pp2tp1dp1"}}
    store.set_launch_spec(job, spec)
    assert store.launch_spec(job) == spec
    with pytest.raises(NotFoundError):
        store.set_launch_spec(99, spec)
    store.close()


def test_steps_come_back_oldest_first_and_limited(tmp_path) -> None:
    clock = FakeClock()
    store = Store(f"sqlite:///{tmp_path / 'x.db'}", clock=clock)
    job = store.create_job("j", "pp1tp1dp1", 1, 1)
    for step in range(1, 6):
        clock.advance(0.5)
        store.record_step(job, step, 10.0 / step, "pp1tp1dp1")
    got = store.steps(job, limit=3)
    assert [s.step for s in got] == [3, 4, 5] and got[0].loss == pytest.approx(10 / 3)
    assert (got[1].at - got[0].at).total_seconds() == pytest.approx(0.5)
    store.close()


def test_cluster_samples_respect_the_minimum_interval(tmp_path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'x.db'}")

    def sample(sec: float, stranded: int) -> ClusterSample:
        return ClusterSample(T0 + timedelta(seconds=sec), "local", Fragmentation(16, 8, stranded, 1, 1, stranded / 8))

    assert store.add_cluster_sample(sample(0, 2), min_interval_s=10)
    assert not store.add_cluster_sample(sample(5, 3), min_interval_s=10)
    assert store.add_cluster_sample(sample(12, 4), min_interval_s=10)
    got = store.cluster_samples()
    assert [(s.figures.stranded, s.figures.index) for s in got] == [(2, 0.25), (4, 0.5)]
    assert store.cluster_samples(since=T0 + timedelta(seconds=1))[0].figures.stranded == 4
    store.close()


def test_change_marks_move_with_placement_migrations_and_requests(tmp_path) -> None:
    clock = FakeClock()
    store = Store(f"sqlite:///{tmp_path / 'x.db'}", clock=clock)
    job = store.create_job("j", "pp1tp2dp1", 2, 4, nodes=["n1"])
    m0 = store.change_marks()
    clock.advance(1)
    store.record_rank_map(job, 0, "pp1tp2dp1", layout_entries(1, 2, 1, ["n1"], 2))
    m1 = store.change_marks()
    assert m1["placement"] != m0["placement"] and m1["migration"] == m0["migration"]
    mid = store.start_migration(job, "pp1tp2dp1", "pp1tp1dp1", "resize", {}, {})
    m2 = store.change_marks()
    assert m2["migration"] != m1["migration"]
    store.finish_migration(mid, "succeeded", 1, 2, True, {"execute": 0.1})
    m3 = store.change_marks()
    assert m3["migration"] != m2["migration"] and m3["request"] == m2["request"]
    rid = store.add_request(job, "shrink", {"nodes": 1}, "ops")
    m4 = store.change_marks()
    store.complete_request(rid, "done", "ok")
    assert m4["request"] != m3["request"] and store.change_marks()["request"] != m4["request"]
    store.close()
