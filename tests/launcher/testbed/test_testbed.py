"""Checks against the REAL slurmctld of the loopback testbed.

The tests share one 4-node job and run in file order: start it, shrink it to
two nodes, run a step there, try an illegal shrink, shrink again to one node
(a second resize only works with accounting on, so this proves slurmdbd is
wired up).
"""
from __future__ import annotations

import subprocess
import time
from typing import Iterator

import pytest

from launcher.cli import main as cli_main
from launcher.backends.slurm.client import SlurmCommands, SlurmError
from launcher.backends.slurm.parse import JobInfo
from launcher.testbed.cluster import Testbed

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_core]

JOB_SCRIPT = "#!/bin/bash\nsleep 300\n"


@pytest.fixture(scope="module")
def backend(slurm_testbed: Testbed) -> SlurmCommands:
    return SlurmCommands(env=slurm_testbed.env())


def _wait_running(backend: SlurmCommands, job_id: int, timeout: float = 15.0) -> JobInfo:
    deadline = time.monotonic() + timeout
    info = backend.job_info(job_id)
    while info.state != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
        info = backend.job_info(job_id)
    assert info.state == "RUNNING", f"job {job_id} did not start: {info}"
    return info


@pytest.fixture(scope="module")
def job(backend: SlurmCommands) -> Iterator[dict]:
    """A 4-node, 4-GPU-per-node batch job running `sleep`; cancelled at the end."""
    job_id = backend.submit(JOB_SCRIPT, extra_args=[
        "--nodes=4", "--gres=gpu:4", "--job-name=elastic-testbed-test", "--output=/dev/null",
        "--time=5"])
    state = {"id": job_id}
    try:
        yield state
    finally:
        backend.cancel(job_id)


def test_sinfo_shows_four_idle_nodes_with_four_gpus(slurm_testbed: Testbed, backend: SlurmCommands) -> None:
    slurm_testbed.up()  # earlier tests may have restarted slurmctld: up() waits until every node is idle again
    nodes = backend.nodes()
    assert [(n.name, n.state, n.gres) for n in nodes] == [(f"n{i}", "idle", "gpu:4") for i in range(1, 5)]


def test_up_is_idempotent_and_cli_reports_up(slurm_testbed: Testbed, capsys) -> None:
    slurm_testbed.up()
    pids = slurm_testbed.daemon_pids()
    assert slurm_testbed.up() == slurm_testbed.slurm_conf
    assert slurm_testbed.daemon_pids() == pids  # a second up() starts nothing new
    assert cli_main(["testbed", "status", "--root", str(slurm_testbed.root)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"export SLURM_CONF={slurm_testbed.slurm_conf}"
    assert cli_main(["testbed", "--root", str(slurm_testbed.root)]) == 0  # no action: the status, as above
    assert capsys.readouterr().out.splitlines()[-2].startswith("up: Slurm ")


def test_job_runs_on_four_nodes(backend: SlurmCommands, job: dict) -> None:
    info = _wait_running(backend, job["id"])
    assert info.nodes == ["n1", "n2", "n3", "n4"] and info.num_nodes == 4
    assert info.batch_host in info.nodes
    job["batch_host"] = info.batch_host


def test_shrink_to_two_keeps_batch_host(backend: SlurmCommands, job: dict) -> None:
    batch = job["batch_host"]
    other = next(n for n in ["n1", "n2", "n3", "n4"] if n != batch)
    backend.shrink(job["id"], [batch, other])
    info = backend.job_info(job["id"])
    assert (info.num_nodes, sorted(info.nodes), info.batch_host) == (2, sorted([batch, other]), batch)
    assert info.state == "RUNNING"
    job["nodes"] = info.nodes


def test_step_on_two_nodes_sees_gpus(backend: SlurmCommands, job: dict) -> None:
    proc = backend.start_step(
        job["id"], job["nodes"], ntasks_per_node=1, gpus_per_node=2, env={"ELASTIC_PROBE": "yes"},
        argv=["bash", "-c", 'echo "$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES $ELASTIC_PROBE"'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert sorted(out.split("\n")[:-1]) == sorted(f"{n} 0,1 yes" for n in job["nodes"])


def test_shrink_without_batch_host_raises(backend: SlurmCommands, job: dict) -> None:
    others = [n for n in job["nodes"] if n != job["batch_host"]]
    with pytest.raises(SlurmError, match="batch host") as exc:
        backend.shrink(job["id"], others)
    assert "Invalid node name" in str(exc.value)
    assert backend.job_info(job["id"]).num_nodes == 2  # unchanged


def test_second_shrink_to_one_node_works(backend: SlurmCommands, job: dict) -> None:
    backend.shrink(job["id"], [job["batch_host"]])
    info = backend.job_info(job["id"])
    assert (info.num_nodes, info.nodes, info.state) == (1, [job["batch_host"]], "RUNNING")
