"""The shared deployment end to end: two `elastic-launch` jobs (local backend, real worker processes,
each launcher its own process) write to one database on the real PostgreSQL server while the
dashboard reads it and `elastic resize` queues requests for both; every request is taken by its own
job's launcher and answered once, and every migration is recorded once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from db import Store
from launcher.cli import main as elastic
from tests.dashboard.conftest import SECRET
from tests.examples.harness import ROOT

pytestmark = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)

WORKER = ["python", "-m", "launcher.worker", "--layers", "4", "--hidden", "64", "--vocab", "128",
          "--log-every", "0", "--step-sleep", "0.2"]


def _launch(url: str, name: str, tmp_path: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "launcher.launch", "--backend", "local", "--nnodes", "1:2", "--gpus-per-node", "1",
           "--layouts", "pp2,pp1", "--db", url, "--job-name", name, "--log-dir", str(tmp_path / name),
           "--poll", "0.1", "--", *WORKER]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(cond: Callable[[], object], what: str, procs: list[subprocess.Popen[str]], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert all(p.poll() is None for p in procs), f"a launcher ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_two_launchers_one_postgres_database_and_the_dashboard(fresh_url: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from dashboard import create_app

    Store(fresh_url).close()  # the schema first; the launchers find it (their concurrent creation: test_concurrency)
    procs = [_launch(fresh_url, name, tmp_path) for name in ("a", "b")]
    store = Store(fresh_url)
    app = create_app({"DB_URL": fresh_url, "SECRET_KEY": SECRET, "TESTING": True})
    app.extensions["elastic_store"].add_user("ops", "ops-password", "viewer")
    client = app.test_client()
    pages = []

    def training(name: str, nodes: int) -> bool:
        job = store.find_job(name)
        current = store.current_rank_map(job.id) if job else None
        pages.append(client.get("/").status_code)  # the dashboard reads while the launchers write
        return bool(current and job.last_step and len({e.node for e in current.entries}) == nodes)

    def answered(rid: int) -> bool:
        return store.get_request(rid).status != "pending"  # type: ignore[union-attr]

    try:
        from tests.dashboard.conftest import csrf_of

        token = csrf_of(client.get("/login").text)
        assert client.post("/login", data={"username": "ops", "password": "ops-password",
                                           "csrf_token": token}).status_code == 302
        _wait(lambda: training("a", 2) and training("b", 2), "both jobs training on 2 nodes", procs)
        rids = []
        for nodes in (1, 2):
            capsys.readouterr()
            for name in ("a", "b"):
                assert elastic(["resize", name, "--nodes", str(nodes), "--db", fresh_url]) == 0
            rids += [int(line) for line in capsys.readouterr().out.split()]
            _wait(lambda: all(answered(r) for r in rids), f"the resizes to {nodes}", procs)
            _wait(lambda: training("a", nodes) and training("b", nodes), f"both jobs training on {nodes}", procs)
        assert client.get(f"/jobs/{store.find_job('a').id}").status_code == 200  # type: ignore[union-attr]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=120)[0] for p in procs]

    assert set(pages) == {200}
    for name, out in zip(("a", "b"), outputs):
        job = store.find_job(name)
        assert job is not None and job.state == "stopped", out
        reqs = sorted(store.list_requests(job.id, limit=100), key=lambda r: r.id)
        assert [(r.action, r.params, r.status) for r in reqs] == [
            ("shrink", {"nodes": 1}, "done"), ("grow", {"nodes": 2}, "done")], out
        assert len({r.taken_by for r in reqs}) == 1  # both taken by this job's launcher, once each
        migs = sorted(store.recent_migrations(job.id, limit=100), key=lambda m: m.id)
        assert [(m.from_layout, m.to_layout, m.status, m.bit_exact) for m in migs] == [
            ("pp2tp1dp1", "pp1tp1dp1", "succeeded", True), ("pp1tp1dp1", "pp2tp1dp1", "succeeded", True)], out
    assert store.history_count() == 4 and len({r.taken_by for r in store.list_requests(limit=100)}) == 2
    store.close()
