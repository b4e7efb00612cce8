"""Failure domains on 2 nodes x 2 devices with pp2dp2 (local backend, real worker processes).

A worker's death fails its device, not its node: the node's other worker trains on. Every worker
of a node dying fails the node. With the default resilient placement the replicas of each stage
start on different nodes, so both failures leave a full replica: the job re-plans from it,
bit-exact, recorded as a succeeded `failure` migration, and no step is repeated or skipped (the
loss of every committed step matches an uninterrupted single-process run).
"""
from __future__ import annotations

from launcher.policy.survival import survival
from tests.launcher.loop.test_faults import check_curve, read_losses, run_job
from tests.records import verification_told

RESILIENT = {"placement": "resilient"}


def _placed_on_both_nodes(la) -> None:
    got = survival(la.current.layout, la.current.devices, {d.id: d.node for d in la.topology.devices})
    assert got.process and got.node


def _one_failure(la, store):
    job = store.find_job("t")
    migs = store.recent_migrations(job.id, limit=10)
    assert [(m.trigger, m.status, m.from_layout) for m in migs] == [
        ("failure", "succeeded", "pp2tp1dp2")], [(m.trigger, m.status, m.error) for m in migs]
    assert verification_told(migs[0]), (migs[0].bit_exact, migs[0].bytes_moved)
    assert job.state == "finished"
    return job, migs[0]


def test_one_worker_dies_its_node_trains_on(tmp_path, monkeypatch) -> None:
    seen = []
    rc, la, store, loss_file, _took = run_job(
        tmp_path, monkeypatch, nodes=2, gpn=2, layouts="pp2dp2,pp2", fault="2:step:5", stop_at=10, max_s=550,
        options=RESILIENT, script=[(1, lambda la: seen.append(_placed_on_both_nodes(la)))])
    assert rc == 0 and seen, [o.message for o in la.outcomes]
    job, mig = _one_failure(la, store)
    assert mig.to_layout == "pp2tp1dp1"
    assert "failed" not in {n.state for n in store.list_nodes(job.id)}, "a worker's death fails no node"
    assert 2 not in la.current.devices and la.lost == {2}
    check_curve(read_losses(loss_file), 10)


def _kill_node1(la) -> None:
    for p in la.handles["node1"].procs.values():
        p.kill()


def test_every_worker_of_a_node_dies_the_job_trains_on_the_other(tmp_path, monkeypatch) -> None:
    rc, la, store, loss_file, _took = run_job(tmp_path, monkeypatch, nodes=2, gpn=2, layouts="pp2dp2,pp2",
                                              stop_at=10, max_s=550, options=RESILIENT, script=[(3, _kill_node1)])
    assert rc == 0, [o.message for o in la.outcomes]
    job, mig = _one_failure(la, store)
    assert mig.to_layout == "pp2tp1dp1"
    assert {n.name: n.state for n in store.list_nodes(job.id)}["node1"] == "failed"
    assert {la.topology.devices[d].node for d in la.current.devices} == {"node0"}
    check_curve(read_losses(loss_file), 10)
