"""The launcher end to end with the local backend: real worker processes on this machine, real
migrations, requests written by `elastic resize`/`elastic preempt`, records read back from SQLite."""
from __future__ import annotations

import pytest

from db import Store
from launcher.cli import main as elastic
from launcher.launch import Launcher, Options
from launcher.backends.local import LocalNodes
from migrate.layout import ParallelConfig

WORKER = ["python", "-m", "launcher.worker", "--layers", "4", "--hidden", "128", "--vocab", "512", "--log-every", "0"]


def run_job(tmp_path, script, nodes=2, gpn=2, layouts="pp2tp2,pp2", min_nodes=1, max_steps=300, node_gpus=(),
            layers=4):
    """Run a job; `script` is [(steps, fn(launcher, db_url))]: each fn runs once the job has trained
    `steps` more steps since the previous action was carried out; then the job is stopped.
    `node_gpus`: uneven simulated nodes (GPUs of each)."""
    url = f"sqlite:///{tmp_path}/e.db"
    store = Store(url)
    worker = [str(layers) if w == "4" and WORKER[i - 1] == "--layers" else w for i, w in enumerate(WORKER)]
    opts = Options(min_nodes, nodes, gpn, [ParallelConfig.parse(x) for x in layouts.split(",")], worker,
                   job_name="t", poll=0.1, ready_timeout=120, migrate_timeout=120, node_gpus=tuple(node_gpus))
    la = Launcher(opts, LocalNodes(nodes, gpn, log_dir=tmp_path / "logs", node_gpus=node_gpus), store)
    todo = list(script) + [(2, None)]
    mark = [0]

    def until(la: Launcher) -> bool:
        step = la.max_step()
        assert step < max_steps, f"script stuck at step {step}; outcomes {la.outcomes}"
        if la.db.pending_requests(la.job_id):
            return False  # let the launcher carry it out first
        if step >= mark[0] + todo[0][0]:
            _k, fn = todo.pop(0)
            if fn is None:
                return True
            fn(la, url)
            mark[0] = la.max_step()
        return False

    rc = la.run(until=until)
    return rc, la, store, url


def test_resize_requests_shrink_and_grow_with_bit_exact_records(tmp_path, capsys):
    def shrink(la, url):
        assert elastic(["resize", "t", "--nodes", "1", "--db", url]) == 0

    def grow(la, url):
        # the launcher carried out the shrink before this step was reached; wait for it then grow
        assert elastic(["resize", "t", "--nodes", "2", "--db", url]) == 0

    rc, la, store, url = run_job(tmp_path, [(3, shrink), (3, grow)])
    assert rc == 0, [o.message for o in la.outcomes]
    oks = [o for o in la.outcomes if o.migration_id]
    assert [(o.from_layout, o.to_layout, o.ok) for o in oks] == [
        ("pp2tp2dp1", "pp2tp1dp1", True), ("pp2tp1dp1", "pp2tp2dp1", True)]
    job = store.find_job("t")
    assert job.state == "finished"
    maps = store.rank_maps(job.id)
    assert [m.layout for m in maps] == ["pp2tp2dp1", "pp2tp1dp1", "pp2tp2dp1"]
    assert {e.node for e in maps[1].entries} == {"node0"}
    assert {e.node for e in maps[2].entries} == {"node0", "node1"}
    migs = store.recent_migrations(job.id, limit=10)
    assert len(migs) == 2
    for m in migs:
        assert m.status == "succeeded" and m.trigger == "resize" and m.bit_exact is True
        assert set(m.phases) == {"plan", "build_groups", "execute", "rebuild", "other"}
        assert m.bytes_moved > 0 and m.bytes_checkpoint > m.bytes_moved
        # the pause runs from the old layout's last commit to the new one's first: it holds the transfer
        assert m.pause_s is not None and m.pause_s >= m.phases["execute"]
    assert sorted(o.pause_s for o in oks) == sorted(m.pause_s for m in migs)
    reqs = store.list_requests(job.id)
    assert [r.status for r in reqs] == ["done", "done"]
    nodes = {n.name: n.state for n in store.list_nodes(job.id)}
    assert nodes["node0"] == "active"
    # every worker exited cleanly
    assert not la.handles
    # what the dashboard's cluster view reads: the launch spec (policy per size) and the reported losses
    spec = store.launch_spec(job.id)
    assert spec["layouts"] == {"2": "pp2tp1dp1", "4": "pp2tp2dp1"} and spec["model"]["layers"] == 4
    # pp2tp2dp1 has no replica: neither a process's nor a node's loss is covered (shown on the job page); the
    # batch node's loss is survived on no backend yet
    assert spec["survives"] == {"process": False, "node": False, "batch": False} and spec["checkpoint_every"] == 0
    steps = store.steps(job.id)
    assert steps and all(s.loss is not None and s.loss > 0 for s in steps)
    assert {s.layout for s in steps} == {"pp2tp2dp1", "pp2tp1dp1"}
    assert [s.step for s in steps] == list(range(1, la.max_step() + 1))  # every step once, in order, the
    # ones that ran while the launcher was busy migrating too


def test_preempt_of_the_batch_node_is_refused_and_a_dead_worker_is_recorded(tmp_path):
    def preempt_batch(la, url):
        job = la.db.get_job(la.job_id)
        la.db.add_request(job.id, "preempt", {"nodes": ["node0"]}, "tester")

    def kill(la, url):
        la.handles["node1"].kill_device(3)

    rc, la, store, url = run_job(tmp_path, [(2, preempt_batch), (4, kill)], layouts="pp2tp2,pp2")
    job = store.find_job("t")
    reqs = store.list_requests(job.id)
    assert reqs[0].status == "failed" and "batch step" in reqs[0].message
    # pp2tp2 has no replicas: losing device 3 cannot be recovered, and that is recorded
    migs = store.recent_migrations(job.id, limit=10)
    assert migs and migs[0].trigger == "failure" and migs[0].status == "failed" and migs[0].error
    # a worker's death fails its device, not its node (issue 15): node1 stays, device 3 is recorded
    assert store.list_nodes(job.id)[1].state != "failed"
    assert any("device 3 on node1 failed" in a.result for a in store.audit_log(target=f"job:{job.id}"))
    assert rc == 1 and job.state == "failed"


def test_a_stranger_on_the_control_plane_neither_stops_nor_steers_a_running_job(tmp_path, capsys):
    """Issue 46: a plain TCPStore client that wrote `abort/w0` froze a job. Now its writes end its connection
    and training goes on; the launcher says who was refused."""
    from datetime import timedelta

    import torch.distributed as dist

    tried = []

    def stranger(la, url):
        step = la.max_step()
        writes = [("abort/w0", "1"), ("abort/w1", "1"), (f"c/w0/{step + 1}", "no"), ("ev/1", '{"kind": "stop"}')]
        for key, value in writes:  # each on a fresh connection: the server ends one at its first request
            client = dist.TCPStore("127.0.0.1", la.ctl.port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=2))
            client.set(key, value)
            tried.append(key)
        with pytest.raises(dist.DistNetworkError):
            dist.TCPStore("127.0.0.1", la.ctl.port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=2)).get("model")
        assert not any(la.ctl.has(key) for key in tried)

    rc, la, store, url = run_job(tmp_path, [(3, stranger), (10, lambda la, url: None)])
    assert len(tried) == 4 and rc == 0, [o.message for o in la.outcomes]
    job = store.find_job("t")
    assert job.state == "finished" and not store.recent_migrations(job.id, limit=5)
    assert la.ctl.server.refusals.count == 5
    assert "control plane: refused a connection from 127.0.0.1:" in capsys.readouterr().err
