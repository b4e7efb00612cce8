"""`elastic history`, `resize`, `preempt` and `dashboard --add-user` through launcher.cli.main."""
from __future__ import annotations

import csv
import io
import json
import os
import pwd
from pathlib import Path

import pytest

from db import Store
from launcher.cli import main
from db.exports import RANK_MAP_COLUMNS
from tests.db.backends import both_backends
from tests.db.seed import seed_hetjob, spread_llama


@both_backends
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


KILLED = "workers on node1 did not exit within --term-timeout 5 s of SIGTERM; killed"
RELEASED = "component 1 (Slurm job 20): n4 released (scontrol update)"
DECLINED = "declined: training ended (the workers finished their last step, step 40) before the grow"


@both_backends
def test_history_shows_each_migrations_notes_and_why_it_was_declined(url: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """What happened besides the plan (the launcher's notes: workers SIGKILLed after --term-timeout, a
    component giving nodes back) and a decline's reason reach every format of `elastic history`."""
    store = Store(url)
    restart = store.start_migration(1, "pp2tp2dp1", "pp2tp2dp2", "resize", {"restart": 1},
                                    store.fragmentation(1), kind="restart")
    store.add_migration_notes(restart, [KILLED])
    store.add_migration_notes(restart, [RELEASED])
    store.finish_migration(restart, "succeeded", None, None, None, {"stop": 5.2})
    grow = store.start_migration(1, "pp2tp2dp1", "pp2tp2dp2", "resize", {}, store.fragmentation(1))
    store.finish_migration(grow, "declined", None, None, None, {}, error=DECLINED)
    store.close()
    assert main(["history", "--db", url, "--job", "llama"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: i for i, line in enumerate(lines) if line[:1].isdigit()}
    assert lines[rows[str(restart)] + 1:rows[str(restart)] + 3] == [f"    note: {KILLED}", f"    note: {RELEASED}"]
    assert lines[rows[str(grow)] + 1] == f"    {DECLINED}" and rows[str(grow)] + 2 in rows.values()
    assert main(["history", "--db", url, "--json", "--job", "llama"]) == 0
    by_id = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert (by_id[restart]["notes"], by_id[grow]["notes"], by_id[1]["notes"]) == ([KILLED, RELEASED], [], [])
    assert (by_id[grow]["status"], by_id[grow]["error"]) == ("declined", DECLINED)
    assert main(["history", "--db", url, "--csv", "--job", "llama"]) == 0
    cells = {r["id"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert (cells[str(restart)]["notes"], cells[str(grow)]["notes"]) == (f"{KILLED}; {RELEASED}", "")
    assert cells[str(grow)]["error"] == DECLINED


@pytest.mark.parametrize("args", [["--since", "last tuesday"], ["--status", "ok"], ["--trigger", "x"],
                                  ["--limit", "0"], ["--json", "--csv"]])
def test_history_bad_values_exit_2(url: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["history", "--db", url, *args])
    except SystemExit as exc:  # argparse itself rejects --json with --csv
        code = int(exc.code or 0)
    assert code == 2
    assert "error" in capsys.readouterr().err


@both_backends
def test_history_of_an_unknown_job_says_so(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped job is an error naming it, not "no migrations match" (which a job without migrations gets)."""
    for fmt in ([], ["--json"], ["--csv"]):
        assert main(["history", "--db", url, "--job", "lama", *fmt]) == 2
        got = capsys.readouterr()
        assert got.out == "" and got.err.strip() == ("elastic history: error: no job 'lama' in the database; "
                                                     "`elastic jobs` lists them"), got.err
    assert main(["history", "--db", url, "--job", "bert"]) == 0  # a job without migrations
    assert capsys.readouterr().err.strip() == "no migrations match"


def test_history_unknown_db_exits_2_and_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.db"
    assert main(["history", "--db", f"sqlite:///{missing}"]) == 2
    assert "no database at" in capsys.readouterr().err and not missing.exists()
    assert main(["history", "--db", "bogus://x"]) == 2


@both_backends
def test_resize_and_preempt_write_requests(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["resize", "llama", "--nodes", "2", "--db", url]) == 0
    rid = int(capsys.readouterr().out.strip())
    store = Store(url)
    req = store.get_request(rid)
    me = pwd.getpwuid(os.getuid()).pw_name  # the process's own user: a flag or $USER cannot name another
    assert req is not None and (req.action, req.params, req.requested_by) == ("grow", {"nodes": 2}, me)
    spread_llama(store)  # two nodes, so one can be preempted
    assert main(["preempt", "1", "--nodes", "n1", "--db", url]) == 0
    rid2 = int(capsys.readouterr().out.strip())
    assert store.get_request(rid2).params == {"nodes": ["n1"]}  # type: ignore[union-attr]
    assert main(["preempt", "1", "--count", "1", "--db", url]) == 0
    assert store.audit_log()[0].action == "preempt"


@both_backends
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


@both_backends
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


def test_history_rank_maps_say_component_node_and_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`elastic history --rank-maps --job J`: every rank of every epoch with its het-job component."""
    url = f"sqlite:///{tmp_path / 'het.db'}"
    store = Store(url)
    job = seed_hetjob(store)  # pp2tp2dp3 packed on a1, a2 (4 GPUs, component 0), b1, b2 (2 GPUs, component 1)
    store.record_rank_map(job, 1, "pp1tp2dp2", [dict(virtual_rank=i, node="b1" if i < 2 else "b2", gpu=i % 2, pp=0,
                                                     dp=i // 2, tp=i % 2, component=1) for i in range(4)])
    store.close()
    assert main(["history", "--db", url, "--rank-maps", "--job", "het", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 12 + 4 and set(rows[0]) == set(RANK_MAP_COLUMNS)
    first = [(r["virtual_rank"], r["component"], r["node"], r["gpu"]) for r in rows if r["epoch"] == 0]
    assert first == [(i, 0, "a1", i) for i in range(4)] + [(4 + i, 0, "a2", i) for i in range(4)] + [
        (8, 1, "b1", 0), (9, 1, "b1", 1), (10, 1, "b2", 0), (11, 1, "b2", 1)]
    assert {(r["component"], r["node"]) for r in rows if r["epoch"] == 1} == {(1, "b1"), (1, "b2")}
    assert main(["history", "--db", url, "--rank-maps", "--job", "het", "--csv"]) == 0
    csv_rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["node"], r["component"]) for r in csv_rows][8:12] == [("b1", "1"), ("b1", "1"), ("b2", "1"), ("b2", "1")]
    assert main(["history", "--db", url, "--rank-maps", "--job", "het"]) == 0
    table = capsys.readouterr().out
    assert "epoch 0  pp2tp2dp3" in table and "rank 11   component 1  b2 GPU 1  pp1 dp2 tp1" in table
    assert main(["history", "--db", url, "--rank-maps"]) == 2
    assert "--rank-maps needs --job" in capsys.readouterr().err
    assert main(["history", "--db", url, "--rank-maps", "--job", "nope"]) == 2
    assert "no job 'nope'" in capsys.readouterr().err


@both_backends
def test_history_rank_maps_of_a_plain_job_name_no_component(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", "--db", url, "--rank-maps", "--job", "llama"]) == 0
    table = capsys.readouterr().out
    assert "epoch 1  pp2tp2dp1" in table and "rank 3    n1 GPU 3  pp1 dp0 tp1" in table and "component" not in table


@both_backends
def test_history_shows_the_step_a_migration_applied_at(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The applied step and the steps a restore lost, in the table, JSON and CSV; every field of --json
    is explained in `elastic history --help`."""
    from db.store import HISTORY_COLUMNS

    store = Store(url)
    mid = store.start_migration(1, "pp2tp2dp2", "pp2tp2dp1", "failure", {}, store.fragmentation(1))
    store.finish_migration(mid, "succeeded", None, 10, None, {"rebuild": 1.0}, at_step=7, steps_lost=2)
    store.close()
    assert main(["history", "--db", url, "--json", "--trigger", "failure"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["at_step"], row["steps_lost"]) == (7, 2)
    assert main(["history", "--db", url, "--csv", "--trigger", "failure"]) == 0
    (got,) = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert (got["at_step"], got["steps_lost"]) == ("7", "2")
    assert main(["history", "--db", url, "--trigger", "failure"]) == 0
    out = capsys.readouterr().out
    assert "AT STEP" in out.splitlines()[0] and "7 (2 lost)" in out
    with pytest.raises(SystemExit):
        main(["history", "--help"])
    helped = capsys.readouterr().out
    fields = [c for c in HISTORY_COLUMNS if not c.endswith("_s") or c in ("duration_s", "pause_s")]
    assert [c for c in fields if c not in helped] == []
