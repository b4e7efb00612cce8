"""`elastic history`, `resize`, `preempt` and `dashboard --add-user` through launcher.cli.main."""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import pytest

from db import Store
from launcher.cli import main
from tests.db.seed import spread_llama


def test_history_table_json_csv(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", "--db", url]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "pp2tp2dp2 -> pp2tp2dp1" in out and "bit-exact" in out
    assert "PAUSE" in out and "10.25" in out and "0.50/1.50/6.00/2.00/-" in out  # pause and the phases
    assert main(["history", "--db", url, "--json", "--job", "llama", "--since", "2024-05-01"]) == 0
    rows = json.loads(capsys.readouterr().out)
    store = Store(url)
    assert rows == store.history(job="llama")
    assert (rows[0]["pause_s"], rows[0]["execute_s"], rows[0]["other_s"]) == (10.25, 6.0, None)
    assert main(["history", "--db", url, "--csv", "--status", "succeeded", "--trigger", "resize"]) == 0
    csv_rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["id"] for r in csv_rows] == ["1"]
    assert (csv_rows[0]["pause_s"], csv_rows[0]["plan_s"], csv_rows[0]["rebuild_s"]) == ("10.25", "0.5", "2.0")
    assert main(["history", "--db", url, "--json", "--until", "2024-04-30"]) == 0
    assert json.loads(capsys.readouterr().out) == []


@pytest.mark.parametrize("args", [["--since", "last tuesday"], ["--status", "ok"], ["--trigger", "x"],
                                  ["--limit", "0"], ["--json", "--csv"]])
def test_history_bad_values_exit_2(url: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["history", "--db", url, *args])
    except SystemExit as exc:  # argparse itself rejects --json with --csv
        code = int(exc.code or 0)
    assert code == 2
    assert "error" in capsys.readouterr().err


def test_history_unknown_db_exits_2_and_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.db"
    assert main(["history", "--db", f"sqlite:///{missing}"]) == 2
    assert "no database at" in capsys.readouterr().err and not missing.exists()
    assert main(["history", "--db", "bogus://x"]) == 2


def test_resize_and_preempt_write_requests(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["resize", "llama", "--nodes", "2", "--db", url, "--user", "ops"]) == 0
    rid = int(capsys.readouterr().out.strip())
    store = Store(url)
    req = store.get_request(rid)
    assert req is not None and (req.action, req.params, req.requested_by) == ("grow", {"nodes": 2}, "ops")
    spread_llama(store)  # two nodes, so one can be preempted
    assert main(["preempt", "1", "--nodes", "n1", "--db", url]) == 0
    rid2 = int(capsys.readouterr().out.strip())
    assert store.get_request(rid2).params == {"nodes": ["n1"]}  # type: ignore[union-attr]
    assert main(["preempt", "1", "--count", "1", "--db", url]) == 0
    assert store.audit_log()[0].action == "preempt"


@pytest.mark.parametrize("argv, message", [
    (["resize", "ghost", "--nodes", "2"], "no job 'ghost'"),
    (["resize", "llama", "--nodes", "1"], "already runs on 1"),
    (["resize", "llama", "--nodes", "9"], "at most 2 nodes"),
    (["preempt", "llama", "--nodes", "n7"], "does not hold n7"),
    (["preempt", "llama", "--count", "5"], "none can go"),
    (["preempt", "ghost", "--count", "1"], "no job"),
])
def test_bad_requests_exit_2_and_write_nothing(url: str, argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--db", url]) == 2
    assert message in capsys.readouterr().err
    assert Store(url).list_requests() == []


def test_resize_unknown_db(tmp_path: Path) -> None:
    assert main(["resize", "x", "--nodes", "1", "--db", str(tmp_path / "none.db")]) == 2
    assert not (tmp_path / "none.db").exists()


def test_dashboard_user_management(url: str, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("a-long-password\n"))
    assert main(["dashboard", "--db", url, "--add-user", "alice", "--role", "admin", "--password-stdin"]) == 0
    assert Store(url).verify_user("alice", "a-long-password").is_admin  # type: ignore[union-attr]
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    assert main(["dashboard", "--db", url, "--add-user", "bob", "--password-stdin"]) == 2
    assert main(["dashboard", "--db", url, "--list-users"]) == 0
    assert "alice\tadmin" in capsys.readouterr().out


def test_dashboard_refuses_to_serve_without_secret(url: str, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("ELASTIC_SECRET_KEY", raising=False)
    assert main(["dashboard", "--db", url]) == 2
    assert "ELASTIC_SECRET_KEY" in capsys.readouterr().err
    assert "ELASTIC_SECRET_KEY" not in os.environ
