"""CLI answers to issue 12's inputs: one-line errors (exit 2), never tracebacks, and read-only
commands that leave foreign or older files exactly as they were."""
from __future__ import annotations

import csv
import io
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from db import Store
from db.schema import CURRENT_VERSION, MIGRATIONS, _stamp, create_v1
from launcher.cli import main
from tests.db.backends import both_backends

from tests.paths import ROOT


@pytest.mark.parametrize("args", [
    ["--since", "0001-01-01T00:00:00+01:00"], ["--until", "9999-12-31T23:59:59-01:00"],
    ["--job", "99999999999999999999"], ["--since", "\u0662\u0660\u0662\u0664-01-01"], ["--limit", "\u0661"],
])
def test_history_hostile_values_exit_2_without_traceback(url: str, args: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", "--db", url, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elastic history: error:") and "Traceback" not in err


@pytest.mark.parametrize("argv", [["resize", "99999999999999999999", "--nodes", "2"],
                                  ["preempt", "99999999999999999999", "--count", "1"]])
def test_request_commands_with_huge_ids_say_no_such_job(url: str, argv: list[str],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--db", url]) == 2
    assert "no job" in capsys.readouterr().err


def test_history_csv_neutralises_formulas(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    store = Store(url)
    job = store.create_job("=cmd|' /C calc'!A0", "pp1tp1dp1", 1, 1)
    store.start_migration(job, "@x", "\tpp1", "demo", {}, {})
    store.close()
    assert main(["history", "--db", url, "--csv", "--job", str(job)]) == 0
    (row,) = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert (row["job_name"], row["from_layout"], row["to_layout"]) == ("'=cmd|' /C calc'!A0", "'@x", "'\tpp1")


def test_history_into_a_closed_pipe_prints_no_traceback(url: str) -> None:
    store = Store(url)
    for _ in range(300):
        store.start_migration(1, "pp2tp2dp1", "pp2tp2dp2", "demo", {}, {})
    store.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(f"'{sys.executable}' -m launcher.cli history --db '{url}' --csv --limit 1000 | head -1",
                          shell=True, capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout.startswith("id,") and proc.stderr == ""


def test_dashboard_config_with_a_bad_port_is_a_usage_error(url: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "d.toml"
    cfg.write_text('secret_key = "0123456789abcdef0123"\nport = "abc"\n')
    assert main(["dashboard", "--db", url, "--config", str(cfg)]) == 2
    assert "port must be a whole number in 1..65535" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_dashboard_port_out_of_range_is_refused(url: str, port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["dashboard", "--db", url, "--port", port])
    assert exc.value.code == 2 and "bad port" in capsys.readouterr().err


def test_add_user_without_a_terminal_is_a_usage_error(url: str, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    def no_tty(prompt: str = "") -> str:
        raise EOFError

    monkeypatch.setattr("getpass.getpass", no_tty)
    assert main(["dashboard", "--db", url, "--add-user", "carol"]) == 2
    assert "--password-stdin" in capsys.readouterr().err


# ------------------------------------------------------------ read-only commands (item 7)
def _v4_database(where: Path | str) -> None:
    """A database at schema v4: a SQLite file at a path, or the database at a URL."""
    engine = create_engine(f"sqlite:///{where}" if isinstance(where, Path) else where)
    create_v1(engine)
    with engine.begin() as conn:
        for step in MIGRATIONS[:3]:
            step(conn)
        _stamp(conn, 4)
    engine.dispose()


def _snapshot(path: Path) -> tuple[bytes, list[str]]:
    return path.read_bytes(), sorted(p.name for p in path.parent.iterdir())


@pytest.mark.parametrize("kind", ["foreign", "empty", "older"])
def test_history_leaves_foreign_empty_and_older_files_untouched(tmp_path: Path, kind: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.db"
    if kind == "foreign":
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE photos (id int)")
        con.commit()
        con.close()
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        _v4_database(path)
    before = _snapshot(path)
    assert main(["history", "--db", str(path)]) == 2
    err = capsys.readouterr().err
    assert ("elastic db upgrade" in err) if kind == "older" else ("not an elastic database" in err)
    assert _snapshot(path) == before  # same bytes (no WAL switch, no growth), no -wal/-shm files
    if kind == "older":
        assert sqlite3.connect(path).execute("SELECT version FROM schema_version").fetchone() == (4,)


def test_db_upgrade_is_the_explicit_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "old.db"
    _v4_database(path)
    assert main(["db", "version", "--db", str(path)]) == 0
    assert f"schema version 4; this release: {CURRENT_VERSION}" in capsys.readouterr().out
    assert main(["db", "upgrade", "--db", str(path)]) == 0
    assert f"schema version 4 -> {CURRENT_VERSION}" in capsys.readouterr().err
    assert main(["history", "--db", str(path)]) == 0
    assert main(["db", "upgrade", "--db", str(path)]) == 0
    assert "already at" in capsys.readouterr().err
    assert main(["db", "upgrade", "--db", str(tmp_path / "missing.db")]) == 2
    assert not (tmp_path / "missing.db").exists()


def test_dashboard_refuses_an_older_schema(tmp_path: Path) -> None:
    from db import DatabaseError
    from dashboard import create_app

    path = tmp_path / "old.db"
    _v4_database(path)
    with pytest.raises(DatabaseError, match="elastic db upgrade"):
        create_app({"DB_URL": f"sqlite:///{path}", "SECRET_KEY": "k" * 32})


def test_jobs_is_read_only_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "old.db"
    _v4_database(path)
    before = _snapshot(path)
    assert main(["jobs", "--db", str(path)]) == 2
    assert "elastic db upgrade" in capsys.readouterr().err and _snapshot(path) == before


@both_backends
def test_every_command_on_an_older_schema_then_db_upgrade(fresh_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The same path on PostgreSQL as on SQLite: read-only commands and the dashboard refuse a v4
    database and name `elastic db upgrade`; it upgrades; then every command works on it."""
    from dashboard import create_app
    from db import DatabaseError

    _v4_database(fresh_url)
    for argv in (["history"], ["jobs"], ["resize", "1", "--nodes", "1"]):
        assert main([*argv, "--db", fresh_url]) == 2
        assert "elastic db upgrade" in capsys.readouterr().err
    with pytest.raises(DatabaseError, match="elastic db upgrade"):
        create_app({"DB_URL": fresh_url, "SECRET_KEY": "k" * 32})
    assert main(["db", "version", "--db", fresh_url]) == 0
    assert f"schema version 4; this release: {CURRENT_VERSION}" in capsys.readouterr().out
    assert main(["db", "upgrade", "--db", fresh_url]) == 0
    assert f"schema version 4 -> {CURRENT_VERSION}" in capsys.readouterr().err

    store = Store(fresh_url, create=False, upgrade_schema=False)
    jid = store.create_job("after", "pp1tp1dp2", 1, 2, nodes=["a", "b"])
    store.close()
    assert main(["jobs", "--db", fresh_url]) == 0 and "after" in capsys.readouterr().out
    assert main(["history", "--db", fresh_url]) == 0
    assert main(["suspend", str(jid), "--db", fresh_url]) == 0
    assert capsys.readouterr().out.strip().isdigit()
    app = create_app({"DB_URL": fresh_url, "SECRET_KEY": "k" * 32, "TESTING": True})
    app.extensions["elastic_store"].close()
