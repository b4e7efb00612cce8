"""`elastic jobs` (table, --state, --json), the v5 -> v6 upgrade (job mode, last step, migration kind),
and requests refused for a job that is not running."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from db import Store
from db.schema import CURRENT_VERSION, MIGRATIONS, _stamp, create_v1
from launcher.cli import main
from tests.db.backends import both_backends


@pytest.fixture
def url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    u = f"sqlite:///{tmp_path / 'jobs.db'}" if backend == "sqlite" else request.getfixturevalue("fresh_url")
    s = Store(u)
    live = s.create_job("gpt", "pp2tp1dp1", 1, 2, slurm_job_id="77", pinned_node="n1", nodes=["n1", "n2"])
    s.update_job(live, last_step=42)
    s.set_launch_spec(live, {"survives": {"process": True, "node": False, "batch": True}, "checkpoint_every": 50})
    s.create_job("ddp", "pp1tp1dp2", 1, 2, nodes=["node0", "node1"], mode="restart")
    old = s.create_job("old", "pp1tp1dp1", 1, 1, nodes=["x"])
    s.set_job_state(old, "stopped")
    s.close()
    return u


@both_backends
def test_jobs_table_lists_mode_nodes_and_last_step(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["jobs", "--db", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "SLURM", "STATE", "MODE", "LAYOUT", "NODES", "STEP", "SURVIVES"]
    assert lines[1].split() == ["1", "gpt", "77", "running", "live", "pp2tp1dp1", "n1,n2", "42", "process", "✓",
                                "node", "✗", "batch", "✓"]
    assert lines[2].split() == ["2", "ddp", "-", "running", "restart", "pp1tp1dp2", "node0,node1", "-", "-"]
    assert lines[3].split()[:4] == ["3", "old", "-", "stopped"]


@both_backends
def test_jobs_json_and_state_filter(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["jobs", "--db", url, "--state", "running", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [(j["name"], j["mode"], j["last_step"], j["nodes"]) for j in got] == [
        ("gpt", "live", 42, ["n1", "n2"]), ("ddp", "restart", None, ["node0", "node1"])]
    assert got[0]["survives"] == {"process": True, "node": False, "batch": True, "checkpoint_every": 50,
                                  "node_note": ""} and got[1]["survives"] is None
    assert main(["jobs", "--db", url, "--state", "finished"]) == 0
    assert "no jobs in state finished" in capsys.readouterr().err


WHY = "workers [0, 1] failed and --max-restarts 3 is used up"


@both_backends
def test_a_failed_job_says_why(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Why the launcher gave a job up (Store.set_job_state(..., why=)) is under its row and in --json; a job
    that failed before launchers said why, and one that is not failed, say nothing."""
    s = Store(url)
    s.set_job_state(2, "failed", why=WHY)
    s.set_job_state(3, "failed")  # no reason given
    s.close()
    assert main(["jobs", "--db", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:4] == ["2", "ddp", "-", "failed"] and lines[3] == f"    failed: {WHY}", lines
    assert lines[4].split()[:4] == ["3", "old", "-", "failed"] and len(lines) == 5, lines
    assert main(["jobs", "--db", url, "--json"]) == 0
    assert [j["why"] for j in json.loads(capsys.readouterr().out)] == [None, WHY, None]


@both_backends
@pytest.mark.parametrize("argv", [["resize", "old", "--nodes", "2"], ["preempt", "old", "--count", "1"]])
def test_requests_for_a_job_that_is_not_running_are_refused(url: str, argv: list[str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--db", url]) == 2
    assert "is stopped, not running" in capsys.readouterr().err
    assert Store(url).pending_requests(3) == []


def test_upgrade_from_v5_adds_mode_last_step_and_kind(tmp_path: Path) -> None:
    path = tmp_path / "v5.db"
    engine = create_engine(f"sqlite:///{path}")
    create_v1(engine)
    with engine.begin() as conn:
        MIGRATIONS[0](conn)
        MIGRATIONS[1](conn)
        MIGRATIONS[2](conn)
        MIGRATIONS[3](conn)
        _stamp(conn, 5)
    engine.dispose()
    con = sqlite3.connect(path)
    con.execute("INSERT INTO jobs (name, state, layout, gpus_per_node, max_devices, created_at, updated_at)"
                " VALUES ('j3', 'running', 'pp2tp1dp1', 1, 2, '2024-01-01 00:00:00', '2024-01-01 00:00:00')")
    con.commit()
    con.close()
    store = Store(f"sqlite:///{path}")
    assert (store.schema_found, store.schema_version) == (5, CURRENT_VERSION) and CURRENT_VERSION >= 6
    job = store.find_job("j3")
    assert (job.mode, job.last_step) == ("live", None)
    mid = store.start_migration(job.id, "pp2tp1dp1", "pp1tp1dp1", "resize", {}, {}, kind="restart")
    store.finish_migration(mid, "succeeded", None, None, None, {"stop": 0.5, "start": 1.5})
    m = store.get_migration(mid)
    assert m.kind == "restart" and m.phases == {"stop": 0.5, "start": 1.5}
    assert store.history(job="j3")[0]["kind"] == "restart"
    with pytest.raises(ValueError, match="migration kind"):
        store.start_migration(job.id, "a", "b", "resize", {}, {}, kind="teleport")
