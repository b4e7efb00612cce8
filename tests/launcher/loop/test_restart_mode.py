"""Restart mode's contract and its errors, through the real `elastic-launch` (local backend, real processes):
torchrun's variables on 2 nodes x 2 devices, a missing program in one line, a worker that exits before
registering named with its exit code and log, a live-mode program that never joins, and a launcher
stopped by SIGTERM ending its job as `stopped`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from db import Store
from db.requests import held_nodes

from tests.paths import ROOT
DUMP_ENV = ("import json, os, sys; keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', "
            "'MASTER_ADDR', 'MASTER_PORT', 'TORCHELASTIC_RESTART_COUNT', 'TORCHELASTIC_RUN_ID', 'ELASTIC_STORE'); "
            "json.dump({k: os.environ.get(k) for k in keys}, open(sys.argv[1] + '/' + os.environ['RANK'], 'w'))")


def launch(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launcher.launch", "--backend", "local", "--db", f"sqlite:///{tmp_path}/e.db",
           "--log-dir", str(tmp_path / "logs"), "--poll", "0.05", *args]
    return subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout)


def test_every_worker_gets_torchruns_variables_and_a_rendezvous_of_its_own(tmp_path: Path) -> None:
    out = tmp_path / "env"
    out.mkdir()
    r = launch(tmp_path, "--nnodes", "2", "--gpus-per-node", "2", "--job-name", "envs", "--",
               "python", "-c", DUMP_ENV, str(out))
    assert r.returncode == 0, r.stderr
    envs = {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, env in envs.items():
        assert (env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(rank % 2), str(rank // 2))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["TORCHELASTIC_RESTART_COUNT"]) == ("4", "2", "0")
        assert env["TORCHELASTIC_RUN_ID"] == "envs-1" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] != env["ELASTIC_STORE"].rsplit(":", 1)[1]  # not the launcher's control store
    assert len({e["MASTER_PORT"] for e in envs.values()}) == 1
    job = Store(f"sqlite:///{tmp_path}/e.db").find_job("envs")
    assert (job.state, job.mode, job.layout) == ("finished", "restart", "pp1tp1dp4")


def test_uneven_nodes_number_ranks_node_by_node(tmp_path: Path) -> None:
    """Nodes of 2 and 1 devices: ranks 0,1 on node 0 and 2 on node 1 (GROUP_RANK x LOCAL_WORLD_SIZE would
    give node 1 rank 1 again), each node's own LOCAL_WORLD_SIZE, one world of 3."""
    out = tmp_path / "env"
    out.mkdir()
    r = launch(tmp_path, "--nnodes", "2", "--gpus-per-node", "2,1", "--job-name", "uneven", "--",
               "python", "-c", DUMP_ENV, str(out))
    assert r.returncode == 0, r.stderr
    envs = {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}
    assert {rank: (e["GROUP_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"]) for rank, e in envs.items()} \
        == {0: ("0", "0", "2", "3"), 1: ("0", "1", "2", "3"), 2: ("1", "0", "1", "3")}
    assert Store(f"sqlite:///{tmp_path}/e.db").find_job("uneven").layout == "pp1tp1dp3"


def test_a_missing_program_is_one_line(tmp_path: Path) -> None:
    r = launch(tmp_path, "--", "no-such-program-xyz")
    assert r.returncode == 2 and r.stderr.strip() == "elastic-launch: error: program not found: no-such-program-xyz"
    r = launch(tmp_path, "--", "python", "missing_train.py")
    assert r.returncode == 2 and r.stderr.strip() == "elastic-launch: error: script not found: missing_train.py"


def test_a_worker_that_exits_before_registering_is_named_with_code_and_log(tmp_path: Path) -> None:
    r = launch(tmp_path, "--mode", "live", "--", "python", "-c", "import sys; print('boom'); sys.exit(3)")
    assert r.returncode == 1
    assert "exited before registering (exit codes {0: 3})" in r.stderr
    log = tmp_path / "logs" / "worker-dev0.log"
    assert f"see {log}" in r.stderr and "boom" in log.read_text()
    assert "Traceback" not in r.stderr


def test_a_live_program_that_never_joins_is_told_the_call(tmp_path: Path) -> None:
    r = launch(tmp_path, "--mode", "live", "--ready-timeout", "3", "--", "python", "-c", "import time; time.sleep(20)")
    assert r.returncode == 1 and "must call launcher.runtime.join(...)" in r.stderr


def test_sigterm_to_the_launcher_stops_the_job_and_its_workers(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/e.db"
    pids = tmp_path / "pids"
    pids.mkdir()
    prog = ("import os, signal, sys, time; open(sys.argv[1] + '/' + str(os.getpid()), 'w').close(); "
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-m", "launcher.launch", "--backend", "local", "--db", url,
                             "--nnodes", "2", "--job-name", "longrun", "--poll", "0.05", "--",
                             "python", "-c", prog, str(pids)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    assert Store(url).find_job("longrun").state == "running"
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert Store(url).find_job("longrun").state == "stopped"
    for p in pids.iterdir():  # every worker got SIGTERM and is gone
        assert not Path(f"/proc/{p.name}").exists()


def _holds(url: str, name: str, nodes: int) -> bool:
    """The job's recorded rank map uses `nodes` nodes (a resize is judged against it)."""
    store = Store(url)
    try:
        job = store.find_job(name)
        return job is not None and len(held_nodes(store, job.id)) == nodes
    finally:
        store.close()


def test_a_restart_that_had_to_kill_says_so_in_its_history(tmp_path: Path, capsys) -> None:
    """Workers of the first world ignore SIGTERM: after --term-timeout the launcher kills them, and the
    restart's history says so (such a pause is the timeout's, not the script's)."""
    url = f"sqlite:///{tmp_path}/e.db"
    ready = tmp_path / "ready"
    ready.mkdir()
    prog = ("import os, signal, sys, time\n"
            "first = os.environ['TORCHELASTIC_RESTART_COUNT'] == '0'\n"
            "if first: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "import torch.distributed as dist\n"  # join the world's rendezvous: one key per rank
            "s = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False)\n"
            "s.set('rank' + os.environ['RANK'], '1')\n"
            "open(sys.argv[1] + '/' + os.environ['RANK'] + os.environ['TORCHELASTIC_RESTART_COUNT'], 'w').close()\n"
            "time.sleep(60 if first else 0)\n")
    proc = subprocess.Popen([sys.executable, "-m", "launcher.launch", "--backend", "local", "--db", url,
                             "--nnodes", "1:2", "--job-name", "deaf", "--poll", "0.05", "--term-timeout", "1",
                             "--", "python", "-c", prog, str(ready)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < 2 or not _holds(url, "deaf", 2):  # the world formed and is recorded
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        from launcher.cli import main as elastic

        assert elastic(["resize", "deaf", "--nodes", "1", "--db", url]) == 0
        _out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    store = Store(url)
    (mig,) = store.recent_migrations(store.find_job("deaf").id, limit=5)
    assert (mig.kind, mig.status) == ("restart", "succeeded")
    assert mig.plan_summary["notes"][0] == ("workers on node0,node1 did not exit within --term-timeout 1 s of "
                                            "SIGTERM; killed")
    assert "did not exit within --term-timeout 1 s" in store.list_requests(store.find_job("deaf").id)[0].message
    capsys.readouterr()
    assert elastic(["history", "--db", url, "--job", "deaf"]) == 0  # the user's view of it: a line under the row
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "    note: workers on node0,node1 did not exit within --term-timeout 1 s of SIGTERM; killed", lines


def test_a_worker_that_fails_every_start_uses_up_max_restarts_and_the_job_says_why(tmp_path: Path) -> None:
    """torchrun's --max-restarts: the first world and one restart fail (each after its world formed), then
    the job ends failed, and `elastic jobs` (Store.why_failed) says why; each start left its
    TORCHELASTIC_RESTART_COUNT."""
    seen = tmp_path / "starts"
    seen.mkdir()
    prog = ("import os, sqlite3, sys, time\n"
            "import torch.distributed as dist\n"  # join the world's rendezvous (one key per rank), then fail
            "s = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False)\n"
            "s.set('rank' + os.environ['RANK'], '1')\n"
            "open(sys.argv[1] + '/' + os.environ['TORCHELASTIC_RESTART_COUNT'], 'w').close()\n"
            "db = sqlite3.connect(sys.argv[2])\n"  # a restarted world fails once the launcher saw it form
            "while os.environ['TORCHELASTIC_RESTART_COUNT'] != '0' and not db.execute(\n"
            "        \"select count(*) from migrations where status = 'succeeded'\").fetchone()[0]:\n"
            "    time.sleep(0.05)\n"
            "sys.exit(3)\n")
    r = launch(tmp_path, "--mode", "restart", "--nnodes", "1", "--gpus-per-node", "1", "--max-restarts", "1",
               "--job-name", "crash", "--", "python", "-c", prog, str(seen), str(tmp_path / "e.db"))
    assert r.returncode != 0, r.stderr
    assert sorted(p.name for p in seen.iterdir()) == ["0", "1"]
    store = Store(f"sqlite:///{tmp_path}/e.db")
    job = store.find_job("crash")
    assert (job.state, store.why_failed(job.id)) == ("failed", "workers [0] failed and --max-restarts 1 is used up")


def test_a_script_that_crashes_on_every_start_gets_every_restart(tmp_path: Path) -> None:
    """A worker that exits before its world formed (a crash on import) is a failure like any other: with
    --max-restarts 2 the world starts 3 times (before, the first restart that did not form ended the job)."""
    seen = tmp_path / "starts"
    seen.mkdir()
    prog = "import os, sys; open(sys.argv[1] + '/' + os.environ['TORCHELASTIC_RESTART_COUNT'], 'w').close(); sys.exit(3)"
    r = launch(tmp_path, "--mode", "restart", "--nnodes", "1", "--gpus-per-node", "1", "--max-restarts", "2",
               "--job-name", "crash", "--", "python", "-c", prog, str(seen))
    assert r.returncode != 0, r.stderr
    assert sorted(p.name for p in seen.iterdir()) == ["0", "1", "2"]
    store = Store(f"sqlite:///{tmp_path}/e.db")
    job = store.find_job("crash")
    assert (job.state, store.why_failed(job.id)) == ("failed", "workers [0] failed and --max-restarts 2 is used up")
    restarts = store.history(job="crash")
    assert [(m["kind"], m["status"]) for m in restarts] == [("restart", "failed")] * 2


def test_a_resize_that_comes_as_the_workers_finish_is_answered_the_job_finished(tmp_path: Path) -> None:
    """Rank 0 has completed the script (exit 0) and rank 1 is finishing (it waits for a gate the test opens
    once the request is answered: the race is forced, no timing): the shrink is declined with "the job
    finished", not carried out as a restart of a world whose script is done."""
    from launcher.backends.local import LocalNodes
    from launcher.cli import main as elastic
    from launcher.launch import Launcher, Options

    url = f"sqlite:///{tmp_path}/e.db"
    prog = ("import os, pathlib, sys, time\n"
            "if os.environ['RANK'] == '0': sys.exit(0)\n"
            "while not pathlib.Path(sys.argv[1], 'go').exists(): time.sleep(0.05)\n")
    opts = Options(1, 2, 2, [], ["python", "-c", prog, str(tmp_path)], job_name="late", poll=0.05, mode="restart")
    la = Launcher(opts, LocalNodes(2, 2, log_dir=tmp_path / "logs"), Store(url))
    asked: list[bool] = []

    def until(la: Launcher) -> bool:
        if not asked and la.workers.exited().get(0) == 0:
            asked.append(True)
            assert elastic(["resize", "late", "--nodes", "1", "--db", url]) == 0
        elif asked and not la.db.pending_requests(la.job_id):
            (tmp_path / "go").touch()
        return False

    assert la.run(until=until) == 0 and asked
    store = Store(url)
    job = store.find_job("late")
    (req,) = store.list_requests(job.id)
    assert (job.state, req.status) == ("finished", "failed") and "the job finished" in req.message, req
    (mig,) = store.recent_migrations(job.id, limit=5)
    assert (mig.kind, mig.status) == ("restart", "declined") and "the job finished" in mig.error
    assert la.restarts.count == 0  # no new world was started


def test_the_launcher_says_what_a_forming_world_waits_for(tmp_path: Path) -> None:
    """Rank 0 joins the world's rendezvous at once, rank 1 only once the launcher has said that it waits for
    it (a gate the test opens on that line: no timing): the line names the workers and how many joined."""
    from launcher.backends.local import LocalNodes
    from launcher.launch import Launcher, Options

    prog = ("import os, pathlib, sys, time\n"
            "import torch.distributed as dist\n"
            "while os.environ['RANK'] == '1' and not pathlib.Path(sys.argv[1], 'go').exists(): time.sleep(0.05)\n"
            "s = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False)\n"
            "s.set('rank' + os.environ['RANK'], '1')\n"
            "s.wait(['rank0', 'rank1'])\n")
    said: list[str] = []
    opts = Options(1, 1, 2, [], ["python", "-c", prog, str(tmp_path)], job_name="slow", poll=0.05, mode="restart")
    la = Launcher(opts, LocalNodes(1, 2), Store(f"sqlite:///{tmp_path}/e.db"), log=said.append)
    want = "waiting for 2 workers to join the rendezvous (their init_process_group): 1 joined"

    def until(la: Launcher) -> bool:
        if any(want in x for x in said):
            (tmp_path / "go").touch()
        return False

    assert la.run(until=until) == 0, said
    assert any(want in x for x in said) and said[-1] == "workers finished", said


def test_a_restart_records_the_step_the_script_went_on_from_and_the_steps_it_ran_again(tmp_path: Path) -> None:
    """The script reports its steps (launcher.runtime.report_step) and goes on from its own checkpoint (every
    third step); its first world waits after step 5 for the shrink's restart. The history has the step before
    the new world's first report (3, the checkpoint's, as the script's own log says) and the steps run again
    (4 and 5), `elastic jobs`' STEP is the job's last step, and the timeline has every report."""
    from launcher.backends.local import LocalNodes
    from launcher.cli import main as elastic
    from launcher.launch import Launcher, Options

    url, steps = f"sqlite:///{tmp_path}/e.db", 15
    opts = Options(1, 2, 1, [], ["python", str(Path(__file__).with_name("report_script.py")), str(tmp_path),
                                 str(steps)], job_name="rep", poll=0.05, mode="restart")
    la = Launcher(opts, LocalNodes(2, 1), Store(url))
    asked: list[bool] = []

    def until(la: Launcher) -> bool:
        if not asked and la.restarts.last_step == 5:
            asked.append(True)
            assert elastic(["resize", "rep", "--nodes", "1", "--db", url]) == 0
        return False

    assert la.run(until=until) == 0
    store = Store(url)
    job = store.find_job("rep")
    (mig,) = store.recent_migrations(job.id, limit=5)
    rows = [tuple(map(int, line.split())) for line in (tmp_path / "steps").read_text().splitlines()]
    first_again = next(s for s, restart in rows if restart == 1)
    assert (mig.kind, mig.status, mig.at_step, mig.steps_lost) == ("restart", "succeeded", 3, 2), mig
    assert first_again == 4, rows
    assert [r.step for r in store.steps(job.id)] == [1, 2, 3, 4, 5] + list(range(4, steps + 1))
    assert job.last_step == steps
