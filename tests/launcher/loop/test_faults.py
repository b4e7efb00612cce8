"""Fault injection on real worker processes (local backend): a worker SIGKILLed inside a training
step, and in the middle of a migration. Each test checks the recorded history, the step at which
the job went on, and the loss of every committed step against an uninterrupted single-process run
(pp1: different reduction order, so within 1e-5 relative; no step repeated or skipped)."""
from __future__ import annotations

import time

import pytest

from db import Store
from launcher.launch import Launcher, Options
from launcher.backends.local import LocalNodes
from migrate.layout import ModelSpec, ParallelConfig
from tests.records import verification_told

MODEL = dict(layers=4, hidden=128, vocab=512, seq_len=32)


def worker_cmd(loss_file, *extra):
    return ["python", "-m", "launcher.worker", "--layers", "4", "--hidden", "128", "--vocab", "512",
            "--log-every", "0", "--collective-timeout", "600", "--loss-file", str(loss_file), *extra]


def reference_losses(steps: int) -> list[float]:
    """The same training on one process (pp1tp1dp1), no failures."""
    from migrate.state import initial_state
    from migrate.train import Groups, TrainConfig, Trainer

    model = ModelSpec(**MODEL)
    cfg = ParallelConfig.parse("pp1")
    tr = Trainer(model, cfg, 0, initial_state(model, cfg, 0, 0), [0], Groups(cfg, [0], 0), TrainConfig())
    return [tr.train_step() for _ in range(steps)]


def read_losses(path) -> list[tuple[int, float, str]]:
    """(step, loss, layout) of every whole line written so far (a job still running, or one cancelled, may
    have left a line half written)."""
    text = path.read_text() if path.exists() else ""
    rows = [line.split() for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]
    return [(int(s), float(v), lay) for s, v, lay in rows]


def check_curve(rows, upto: int) -> None:
    steps = [s for s, _v, _l in rows]
    assert steps == list(range(1, len(steps) + 1)), f"steps repeated or skipped: {steps}"
    assert len(steps) >= upto, steps
    ref = reference_losses(len(steps))
    for (s, v, lay), r in zip(rows, ref):
        assert abs(v - r) <= 1e-5 * abs(r), f"step {s} on {lay}: loss {v!r} vs uninterrupted {r!r}"


def recovered(la: Launcher, after: int = 3) -> bool:
    """The failure recovery (a `failure` outcome) is done and its layout trained `after` steps past it."""
    done = [o for o in la.outcomes if o.trigger == "failure" and o.ok]
    return bool(done) and done[0].at_step is not None and la.max_step() >= done[0].at_step + after


def _stuck(la: Launcher, log_dir) -> str:
    """What a job that did not get there did: its outcomes and the end of every worker's log."""
    logs = {f.name: f.read_text().splitlines()[-3:] for f in sorted(log_dir.glob("*.log"))} if log_dir.exists() else {}
    return f"stuck at step {la.max_step()}; outcomes {[(o.trigger, o.ok, o.message) for o in la.outcomes]}; logs {logs}"


def run_job(tmp_path, monkeypatch, *, nodes, gpn, layouts, fault=None, script=(), stop_at=10, max_s=150, options=None,
            until_event=None):
    """Run a local job until the layout's workers report `stop_at` steps and `until_event(launcher)` (if
    given) is true; `script` is [(step, fn(launcher))] run once when that step is reached. Waiting on the
    event, not on a step count alone: a recovery that comes late under load must not be overtaken by
    the step count (the job would stop before it, and the test would fail for want of it)."""
    if fault:
        monkeypatch.setenv("ELASTIC_FAULT", fault)
    url = f"sqlite:///{tmp_path}/e.db"
    store = Store(url)
    loss_file = tmp_path / "loss.txt"
    opts = Options(1, nodes, gpn, [ParallelConfig.parse(x) for x in layouts.split(",")], worker_cmd(loss_file),
                   job_name="t", poll=0.05, ready_timeout=120, migrate_timeout=60, **(options or {}))
    la = Launcher(opts, LocalNodes(nodes, gpn, log_dir=tmp_path / "logs"), store)
    todo = sorted(script)
    t0 = time.monotonic()

    def until(la: Launcher) -> bool:
        assert time.monotonic() - t0 < max_s, _stuck(la, tmp_path / "logs")
        step = la.max_step()
        if todo and step >= todo[0][0]:
            todo.pop(0)[1](la)
        return step >= stop_at and not todo and (until_event is None or until_event(la))

    rc = la.run(until=until)
    return rc, la, store, loss_file, time.monotonic() - t0


def test_worker_killed_in_a_step_recovers_from_replicas_at_the_same_step(tmp_path, monkeypatch):
    # 4 one-device nodes, pp2dp2: device 3 dies inside step 5 (gradients done, before the commit vote)
    rc, la, store, loss_file, _took = run_job(tmp_path, monkeypatch, nodes=4, gpn=1, layouts="pp2dp2,pp2",
                                              fault="3:step:5", stop_at=10, max_s=550)
    assert rc == 0, [o.message for o in la.outcomes]
    fails = [o for o in la.outcomes if o.trigger == "failure"]
    assert len(fails) == 1 and fails[0].ok, [o.message for o in la.outcomes]
    f = fails[0]
    assert (f.from_layout, f.to_layout) == ("pp2tp1dp2", "pp2tp1dp1")
    assert f.at_step == 4  # step 5 was committed by nobody; the survivors all hold step 4
    job = store.find_job("t")
    migs = store.recent_migrations(job.id, limit=10)
    # the survivors already hold their state: nothing crosses, so nothing is compared (bit_exact null)
    assert [(m.trigger, m.status, m.bit_exact, m.bytes_moved) for m in migs] == [("failure", "succeeded", None, 0)]
    assert {n.name: n.state for n in store.list_nodes(job.id)}["node3"] == "failed"
    assert job.state == "finished"
    rows = read_losses(loss_file)
    check_curve(rows, 10)
    assert {lay for s, _v, lay in rows if s <= 4} == {"pp2tp1dp2"}
    assert {lay for s, _v, lay in rows if s >= 5} == {"pp2tp1dp1"}
    # no collective waited out its 600 s timeout: run_job's 550 s hang guard would have failed first


def shrink_to_two(la: Launcher) -> None:
    la.db.add_request(la.job_id, "shrink", {"nodes": 2}, "tester")


@pytest.mark.parametrize("fault", ["1:round:0", "3:commit"])
def test_worker_killed_mid_migration_keeps_the_old_layout_then_recovers(tmp_path, monkeypatch, fault):
    # pp2dp2 on 4 nodes shrinks to pp1dp2 on 2; a participant dies in the first transfer round
    # (a kept device) or after its transfer, before the commit vote (a leaving device)
    rc, la, store, loss_file, _took = run_job(tmp_path, monkeypatch, nodes=4, gpn=1, layouts="pp2dp2,pp1dp2,pp1",
                                              fault=fault, script=[(3, shrink_to_two)], stop_at=12,
                                              until_event=recovered)
    assert rc == 0, [o.message for o in la.outcomes]
    job = store.find_job("t")
    migs = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    assert [(m.trigger, m.status) for m in migs] == [("resize", "failed"), ("failure", "succeeded")], \
        [(m.trigger, m.status, m.error) for m in migs]
    assert "old layout kept" in migs[0].error
    assert migs[1].from_layout == "pp2tp1dp2" and verification_told(migs[1])
    assert store.list_requests(job.id)[0].status == "failed"
    rows = read_losses(loss_file)
    check_curve(rows, 12)
    # nothing trained on a half-migrated layout: pp2dp2 until the failure, then the recovery layout
    layouts = [lay for _s, _v, lay in rows]
    cut = layouts.index(migs[1].to_layout)
    assert set(layouts[:cut]) == {"pp2tp1dp2"} and set(layouts[cut:]) == {migs[1].to_layout}


def test_worker_killed_right_after_a_migration_commits_keeps_the_new_layout(tmp_path, monkeypatch):
    rc, la, store, loss_file, _took = run_job(tmp_path, monkeypatch, nodes=4, gpn=1, layouts="pp2dp2,pp1dp2,pp1",
                                              fault="1:committed", script=[(3, shrink_to_two)], stop_at=12,
                                              until_event=recovered)
    assert rc == 0, [o.message for o in la.outcomes]
    job = store.find_job("t")
    migs = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    assert [(m.trigger, m.status, m.from_layout, m.to_layout) for m in migs] == [
        ("resize", "succeeded", "pp2tp1dp2", "pp1tp1dp2"), ("failure", "succeeded", "pp1tp1dp2", "pp1tp1dp1")], \
        [(m.trigger, m.status, m.error) for m in migs]
    rows = read_losses(loss_file)
    check_curve(rows, 12)
    assert [lay for _s, _v, lay in rows][-1] == "pp1tp1dp1"
