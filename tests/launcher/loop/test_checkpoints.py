"""Suspend/resume and safety checkpoints with real worker processes (local backend).

Suspend: `elastic-launch` runs as its own process; `elastic suspend` (an admin request) or USR1
(--on-signal suspend) makes the workers write the state once and exit; the job is recorded as
suspended with the checkpoint; `elastic-launch --resume` (or a `resume` request) goes on from it
on another layout and device count. The loss of every step is written once, in order, and
matches an uninterrupted run.

Safety checkpoints: with --checkpoint-every 2 on pp2 (no replica), a worker SIGKILLed inside a
step makes the job restart from the last complete checkpoint on the device left, recording the
steps lost.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from db import Store
from launcher.cli import main as elastic
from tests.launcher.loop.test_faults import read_losses, run_job
from tests.launcher.loop.test_faults import reference_losses as _reference

from tests.paths import ROOT


def reference_losses(steps: int) -> list[float]:
    """The uninterrupted run on one process with one thread, like the workers (torch.set_num_threads(1)),
    so a run whose layout differs only in PP gives bit-identical losses."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(steps)
    finally:
        torch.set_num_threads(before)


def launch(tmp_path, *args, worker=(), env=None):
    cmd = [sys.executable, "-m", "launcher.launch", "--backend", "local", "--db", f"sqlite:///{tmp_path}/e.db",
           "--job-name", "sr", "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "logs"),
           "--poll", "0.05", *args, "--", "python", "-m", "launcher.worker", "--layers", "4", "--hidden", "128",
           "--vocab", "512", "--log-every", "0", "--loss-file", str(tmp_path / "loss.txt"), *worker]
    out = open(tmp_path / "launcher.log", "ab")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def wait_steps(tmp_path, n, proc, timeout=90.0):
    deadline = time.monotonic() + timeout
    f = tmp_path / "loss.txt"
    while time.monotonic() < deadline:
        if f.exists() and len(f.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} steps within {timeout} s")


def finish(proc, tmp_path, timeout=120):
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert rc == 0, (tmp_path / "launcher.log").read_text()[-4000:]


def check_continuous(tmp_path, upto, exact=False):
    rows = read_losses(tmp_path / "loss.txt")
    steps = [s for s, _v, _l in rows]
    assert steps == list(range(1, upto + 1)), f"steps repeated, skipped or missing: {steps}"
    ref = reference_losses(upto)
    for (s, v, lay), r in zip(rows, ref):
        if exact:
            assert v == r, f"step {s} on {lay}: loss {v!r} vs uninterrupted {r!r}"
        assert abs(v - r) <= 1e-5 * abs(r), f"step {s} on {lay}: loss {v!r} vs uninterrupted {r!r}"
    return rows


def suspended_job(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/e.db", create=False)
    try:
        return store, store.find_job("sr")
    except Exception:
        store.close()
        raise


def test_suspend_request_then_resume_on_fewer_devices_and_another_layout(tmp_path):
    url = f"sqlite:///{tmp_path}/e.db"
    # 2 nodes x 2 devices, pp2tp2, stopped by `elastic suspend`
    proc = launch(tmp_path, "--nnodes", "2", "--gpus-per-node", "2", "--layouts", "pp2tp2",
                  worker=["--step-sleep", "0.1"])
    wait_steps(tmp_path, 3, proc)
    assert elastic(["suspend", "sr", "--db", url]) == 0
    finish(proc, tmp_path)
    store, job = suspended_job(tmp_path)
    s = job.checkpoint_step
    assert job.state == "suspended" and s >= 3, job
    assert job.checkpoint_path == str((tmp_path / "ck" / f"step-{s}").resolve())
    assert (Path(job.checkpoint_path) / ".metadata").exists()
    assert [p.name for p in (tmp_path / "ck").iterdir()] == [f"step-{s}"]  # one complete checkpoint, no temp
    (req,) = store.list_requests(job.id)
    assert req.action == "suspend" and req.status == "done" and f"step {s}" in req.message
    assert [lay for _s, _v, lay in read_losses(tmp_path / "loss.txt")] == ["pp2tp2dp1"] * s
    store.close()
    # resumed on one device (pp1) with --resume: steps s+1 .. s+3, then the workers stop (--steps)
    proc = launch(tmp_path, "--resume", "--nnodes", "1", "--gpus-per-node", "1", "--layouts", "pp1",
                  worker=["--steps", str(s + 3)])
    finish(proc, tmp_path)
    rows = check_continuous(tmp_path, s + 3)
    assert {lay for st, _v, lay in rows if st > s} == {"pp1tp1dp1"}
    store, job2 = suspended_job(tmp_path)
    assert job2.id == job.id and job2.state == "finished"  # the same job went on
    assert [m.layout for m in store.rank_maps(job.id)] == ["pp2tp2dp1", "pp1tp1dp1"]
    store.close()


def test_usr1_suspends_and_a_resume_request_resumes_with_only_pp_changed(tmp_path):
    url = f"sqlite:///{tmp_path}/e.db"
    proc = launch(tmp_path, "--nnodes", "2", "--gpus-per-node", "1", "--layouts", "pp2", "--on-signal", "suspend",
                  worker=["--step-sleep", "0.1"])
    wait_steps(tmp_path, 3, proc)
    proc.send_signal(signal.SIGUSR1)
    finish(proc, tmp_path)
    store, job = suspended_job(tmp_path)
    s = job.checkpoint_step
    assert job.state == "suspended" and s >= 3
    store.close()
    assert elastic(["resume", "sr", "--db", url]) == 0
    assert elastic(["resume", "sr", "--db", url]) == 2  # an identical pending request is refused (db.requests)
    # the next launcher of the job finds the request: 4 one-device nodes, pp4 (only PP changed)
    proc = launch(tmp_path, "--nnodes", "4", "--gpus-per-node", "1", "--layouts", "pp4", worker=["--steps", str(s + 2)])
    finish(proc, tmp_path)
    rows = check_continuous(tmp_path, s + 2, exact=True)
    assert {lay for st, _v, lay in rows if st > s} == {"pp4tp1dp1"}
    store, job = suspended_job(tmp_path)
    reqs = store.list_requests(job.id)
    assert [(r.action, r.status) for r in reqs] == [("resume", "done")]
    assert f"at step {s}" in reqs[0].message
    store.close()


def test_worker_killed_without_replica_restarts_from_the_safety_checkpoint(tmp_path, monkeypatch, capsys):
    # pp2 on 2 one-device nodes, checkpoint every 2 steps; device 1 dies inside step 7 (6 committed)

    rc, la, store, loss_file, took = run_job(tmp_path, monkeypatch, nodes=2, gpn=1, layouts="pp2,pp1",
                                             fault="1:step:7", stop_at=10,
                                             options={"checkpoint_every": 2, "checkpoint_dir": tmp_path / "ck"})
    assert rc == 0, [o.message for o in la.outcomes]
    job = store.find_job("t")
    (m,) = store.recent_migrations(job.id, limit=10)
    assert (m.trigger, m.status, m.from_layout, m.to_layout) == ("failure", "succeeded", "pp2tp1dp1", "pp1tp1dp1")
    s = m.at_step
    assert s in (4, 6), m  # the newest complete one: 6 unless its background write was still going
    assert m.steps_lost == 6 - s and m.error == f"restored from checkpoint at step {s}: {6 - s} steps lost"
    assert m.bytes_checkpoint > 0 and {n.name: n.state for n in store.list_nodes(job.id)}["node1"] == "failed"
    rows = read_losses(loss_file)
    steps = [st for st, _v, _l in rows]
    assert steps == list(range(1, 7)) + list(range(s + 1, len(steps) - 6 + s + 1)), steps
    assert steps[-1] >= 10
    ref = reference_losses(steps[-1])
    for st, v, lay in rows:  # redone steps give the same losses; PP changed only: bit-identical
        assert v == ref[st - 1], (st, v, ref[st - 1], lay)
    assert {lay for _st, _v, lay in rows[6:]} == {"pp1tp1dp1"}
    # `elastic history` says what happened
    capsys.readouterr()
    assert elastic(["history", "--db", f"sqlite:///{tmp_path}/e.db", "--json"]) == 0
    (h,) = json.loads(capsys.readouterr().out)
    assert h["trigger"] == "failure" and h["error"] == m.error
    assert took < 100, took
