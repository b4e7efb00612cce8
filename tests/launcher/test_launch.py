"""elastic-launch's logic against a mocked Slurm: options, bad input (exit 2, nothing written),
the srun/scontrol commands it builds (golden files), and the node choices of a shrink."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import launcher.backends.slurm.select as slurm_mod
from launcher.launch import main, parse_nnodes
from launcher.errors import UsageError
from launcher.backends.slurm.client import SlurmCommands

from tests.paths import GOLDEN
WORKER = ["--", "python", "-m", "launcher.worker", "--layers", "4", "--hidden", "128"]


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") or not path.exists():
        path.write_text(text)
    assert text == path.read_text(), f"differs from {path} (UPDATE_GOLDEN=1 to accept)"


@pytest.fixture
def fake_slurm(monkeypatch):
    """Slurm that knows job 2 (running on n[1-4], batch host n1) and nothing else."""
    show = (GOLDEN / "scontrol_show_job_running_4.txt").read_text()
    calls: list[list[str]] = []

    def runner(cmd, *, input=None, env=None, timeout=None):
        calls.append(list(cmd))
        cmd = [c for c in cmd if c != "-d"]  # `scontrol show -d job` (the allocation): no GRES lines here
        if cmd[:3] == ["scontrol", "show", "job"] and cmd[3] == "2":
            return subprocess.CompletedProcess(cmd, 0, show, "")
        if cmd[:3] == ["scontrol", "show", "job"]:
            return subprocess.CompletedProcess(cmd, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
        return subprocess.CompletedProcess(cmd, 1, "", f"unexpected {cmd}\n")

    monkeypatch.setattr(slurm_mod, "select_backend", lambda *a, **k: SlurmCommands(runner=runner))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return calls


def only_reads(cmd: list[str]) -> bool:
    """A Slurm command that changes nothing: the job's record, how it was submitted (its --no-kill)."""
    return any(cmd[:len(r)] == r for r in (["scontrol", "show"], ["sacct"], ["scontrol", "write", "batch_script"]))


def test_nnodes_parsing():
    assert parse_nnodes("2:4") == (2, 4)
    assert parse_nnodes("3") == (3, 3)
    for bad in ("0", "4:2", "a:b", "2:", ":3", "-1:2"):
        with pytest.raises(UsageError):
            parse_nnodes(bad)


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--nnodes", "--gpus-per-node", "--layouts", "--db", "--backend", "--dry-run", "--on-signal",
                 "--master-port", "RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        assert flag in text


def test_worker_help_is_clear():
    out = subprocess.run([sys.executable, "-m", "launcher.worker", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "elastic-launch" in out and "--layers" in out and "--steps" in out


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "4:2"], "MIN <= MAX"),
    (["--nnodes", "two"], "MIN:MAX"),
    (["--nnodes", "1:2", "--gpus-per-node", "4", "--layouts", "pp4tp2"], "with 1 node"),
    (["--layouts", "pp2xx"], "cannot read layout"),
    (["--nnodes", "2", "--gpus-per-node", "4", "--layouts", "tp8"], "inside a 4-GPU node"),
    (["--nnodes", "1", "--gpus-per-node", "4", "--layouts", "pp3"], "not divisible by pp=3"),
    (["--backend", "slurm", "--job-id", "77", "--nnodes", "1"], "unknown Slurm job 77"),
    (["--backend", "slurm", "--nnodes", "1"], "needs a job"),
    (["--db", "nosuchdriver://x/y", "--backend", "local", "--nnodes", "1"], ""),
    (["--db", "sqlite:////nonexistent-dir/sub/e.db", "--backend", "local", "--nnodes", "1"], ""),
    (["--backend", "local", "--nnodes", "1:2", "--policy", "opportunistic"], "run it in an sbatch allocation"),
    (["--backend", "local", "--nnodes", "1:2", "--policy-max-per-hour", "0"], "--policy-max-per-hour at least 1"),
])
def test_bad_input_exits_2_and_writes_nothing(argv, message, fake_slurm, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main(argv + WORKER)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("elastic-launch: error: ") and message in err
    assert err.count("\n") == 1, "one clear line, no traceback"
    assert list(tmp_path.iterdir()) == []
    assert not [c for c in fake_slurm if c[:2] == ["scontrol", "update"] or c[0] == "srun"]


@pytest.mark.parametrize("var,says", [("ELASTIC_GLOO_NICE", "$ELASTIC_GLOO_NICE must be a whole number from 0"),
                                      ("ELASTIC_CMA", "$ELASTIC_CMA must be 1")])
def test_a_bad_environment_setting_is_refused_before_anything_starts(fake_slurm, tmp_path, monkeypatch, capsys,
                                                                     var, says):
    """The workers inherit $ELASTIC_GLOO_NICE (launcher.runtime.threads) and $ELASTIC_CMA (migrate.cma):
    elastic-launch reads them first."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(var, "99")
    assert main(["--backend", "local", "--nnodes", "1"] + WORKER) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elastic-launch: error: {says}") and "'99'" in err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []


def test_missing_command_is_a_usage_error(capsys):
    assert main(["--nnodes", "1"]) == 2
    assert "after `--`" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--local-nodes", "99999999"], "more than 512"),  # each simulated device is a process here
    (["--nnodes", "1:4096", "--gpus-per-node", "8"], "more than 512"),
    (["--nnodes", "1:99999999"], "at most 16384 nodes"),
    (["--gpus-per-node", "99999999"], "at most 1024 GPUs per node"),
    (["--gpus-per-node", "4,4,99999999"], "at most 1024 GPUs per node"),
])
def test_counts_too_large_are_refused_before_anything_starts(argv, says, capsys, tmp_path, monkeypatch):
    """The command-line fuzz drew `--local-nodes 99999999`: elastic-launch built a name for every
    simulated node and never answered. Too large a count is a one-line usage error instead."""
    monkeypatch.chdir(tmp_path)
    assert main(["--backend", "local", "--dry-run", *argv, "--", "python", "-m", "launcher.worker"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_dry_run_slurm_prints_srun_and_scontrol_golden(fake_slurm, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["--dry-run", "--backend", "slurm", "--job-id", "2", "--nnodes", "2:4", "--gpus-per-node", "4",
               "--layouts", "pp4tp2,pp2tp4,pp2tp2", "--master-addr", "10.0.0.1", "--db", str(tmp_path / "e.db")]
              + WORKER)
    out = capsys.readouterr().out.replace(sys.executable, "PYTHON").replace(str(tmp_path.resolve()), "TMP")
    assert rc == 0
    golden("launch_dryrun_slurm.txt", out)
    assert "srun --jobid=2 --nodes=1 --nodelist=n1" in out and "--overlap" in out
    assert "scontrol update JobId=2 'NodeList=n[1-2]'" in out
    assert list(tmp_path.iterdir()) == [], "a dry run writes nothing"
    assert all(only_reads(c) for c in fake_slurm), "a dry run changes nothing"


def test_dry_run_local_golden(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    rc = main(["--dry-run", "--nnodes", "1:2", "--gpus-per-node", "2", "--layouts", "pp2tp2,pp2"] + WORKER)
    out = capsys.readouterr().out.replace(sys.executable, "PYTHON").replace(str(tmp_path.resolve()), "TMP")
    assert rc == 0
    golden("launch_dryrun_local.txt", out)
    assert out.count("ELASTIC_DEVICE=") == 4


def test_fresh_processes_says_every_worker_is_a_new_interpreter(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert main(["--dry-run", "--fresh-processes", "--nnodes", "1:2", "--gpus-per-node", "2"] + WORKER) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "# local backend: 2 simulated nodes x 2 devices on this machine, every worker a new interpreter"


def test_one_simulated_node_is_singular():
    from launcher.backends.local import LocalNodes

    assert LocalNodes(1, 2).describe().startswith("local backend: 1 simulated node x 2 devices")


def test_shrink_and_release_choices_keep_the_batch_node():
    """Pure part of a shrink: which nodes stay (batch node first, then the busiest) and the scontrol line."""
    from launcher.launch import Launcher, Options
    from launcher.backends.slurm.nodes import SlurmNodes
    from launcher.backends.slurm.parse import JobInfo
    from migrate.layout import ModelSpec, ParallelConfig
    from migrate.topology import RankMap

    info = JobInfo(job_id=5, state="RUNNING", nodes=["n1", "n2", "n3", "n4"], batch_host="n3", num_nodes=4)
    backend = SlurmNodes(slurm=None, job_id=5, gpus_per_node=2, info=info)
    assert backend.allocation() == ["n3", "n1", "n2", "n4"]
    la = Launcher(Options(2, 4, 2, [], ["x"]), backend, store=None)
    la.handles = {n: None for n in backend.allocation()}
    la.current = RankMap(ParallelConfig(pp=2, tp=2), (2, 3, 4, 5))  # on n1 and n2
    assert la._keep_order()[:2] == ["n3", "n1"]
    assert backend.commands_for_release(["n3", "n1"]) == [["scontrol", "update", "JobId=5", "NodeList=n[1,3]"]]
    from migrate.plan import plan
    from migrate.topology import Topology

    p = plan(ModelSpec(layers=4, hidden=128), RankMap(ParallelConfig(pp=4, tp=2), tuple(range(8))),
             ParallelConfig(pp=2, tp=2), Topology(la.topology.devices, frozenset(["n3", "n1"])))
    assert {la.topology.devices[d].node for d in p.curr.devices} == {"n3", "n1"}
    assert set(p.nodes_released) == {"n2", "n4"}
