"""Reading what a job holds (components, nodes, GPUs per node), and what Slurm 22.05 lets a launcher
do with the components of a heterogeneous job.

The parsers run on output recorded from the testbed in shape 4,4,2,2 (tests/launcher/golden/hetjob_*,
uneven_*). The `slurm` test checks the same reader against the real testbed, with the GPUs each
step actually sees (CUDA_VISIBLE_DEVICES of `srun --het-group=i`) as the oracle, and pins down the
component updates the guide's "Heterogeneous jobs" section (docs/reference/slurm.md) describes.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from launcher.backends.slurm.allocation import Allocation, Component, parse_show_job_detail, parse_squeue_allocation
from launcher.backends.slurm.client import SlurmCommands, SlurmError
from launcher.backends.slurm.commands import (
    build_companion_command,
    build_companion_script,
    build_show_job_command,
    build_srun_command,
)
from launcher.backends.slurm.gres import gres_count as gpu_count  # the one GPU counter; the test kept its name
from launcher.testbed.cluster import Testbed

from tests.paths import GOLDEN
HET = Allocation(19, (Component(0, 19, ("n1",), (4,), "gpu4", "n1"), Component(1, 20, ("n3", "n4"), (2, 2), "gpu2", "n3")))


def _golden(name: str) -> str:
    return (GOLDEN / name).read_text()


def test_heterogeneous_job_from_scontrol_detail() -> None:
    alloc = parse_show_job_detail(_golden("hetjob_show_job_d.txt"))
    assert alloc == HET
    assert alloc.heterogeneous and alloc.batch_host == "n1"
    assert alloc.gpus() == {"n1": 4, "n3": 2, "n4": 2} and alloc.nodes == ["n1", "n3", "n4"]
    assert alloc.component_of("n4").job_id == 20 and alloc.component(1).partition == "gpu2"
    with pytest.raises(KeyError, match="n2"):
        alloc.component_of("n2")


def test_heterogeneous_job_from_squeue_json_agrees() -> None:
    assert parse_squeue_allocation(_golden("hetjob_squeue.json"), 19) == HET


def test_component_shrunk_by_scontrol_update() -> None:
    alloc = parse_show_job_detail(_golden("hetjob_show_job_d_shrunk.txt"))
    assert [(c.offset, c.nodes, c.gpus) for c in alloc.components] == [(0, ("n1",), (4,)), (1, ("n3",), (2,))]


def test_released_component_holds_nothing() -> None:
    """After `scancel <component id>` scontrol still prints the component with its last NodeList."""
    text = _golden("hetjob_show_job_d.txt")
    leader, comp = text.split("\n\nJobId=")
    alloc = parse_show_job_detail(leader + "\n\nJobId=" + comp.replace("JobState=RUNNING", "JobState=CANCELLED"))
    assert alloc.components == HET.components[:1] and alloc.job_id == 19


def test_plain_job_on_uneven_nodes() -> None:
    """`--nodes=3 --gpus=10` gives 4,4,2; `--exclusive` gives every GPU of the nodes."""
    alloc = parse_show_job_detail(_golden("uneven_show_job_d.txt"))
    assert not alloc.heterogeneous
    assert alloc.gpus() == {"n1": 4, "n2": 4, "n3": 2} and alloc.batch_host == "n1"
    assert parse_squeue_allocation(_golden("uneven_squeue.json"), 21) == alloc  # other jobs in the file are skipped
    assert parse_show_job_detail(_golden("uneven_exclusive_show_job_d.txt")).gpus() == {
        "n1": 4, "n2": 4, "n3": 2, "n4": 2}


def test_squeue_without_the_job_is_an_error() -> None:
    with pytest.raises(ValueError, match="job 99 is not in the squeue output"):
        parse_squeue_allocation(_golden("hetjob_squeue.json"), 99)


@pytest.mark.parametrize("gres, n", [("gpu:4(IDX:0-3)", 4), ("gpu:a100:2(IDX:0-1),nic:1", 2), ("", 0),
                                     ("nic:1", 0), ("gpu:1(IDX:0),gpu:v100:2(IDX:1-2)", 3)])
def test_gpu_count(gres: str, n: int) -> None:
    assert gpu_count(gres) == n


def test_srun_names_the_leader_and_the_component() -> None:
    assert build_srun_command(19, ["n4"], 2, 2, {}, ["hostname"], het_group=1) == [
        "srun", "--jobid=19", "--het-group=1", "--nodes=1", "--nodelist=n4", "--ntasks-per-node=2", "--ntasks=2",
        "--gres=gpu:2", "--overlap", "--kill-on-bad-exit=0", "hostname"]
    assert "--het-group" not in " ".join(build_srun_command(19, ["n1"], 1, 0, {}, ["x"]))
    assert build_show_job_command(19, detail=True) == ["scontrol", "show", "-d", "job", "19"]


# ------------------------------------------------------------------------------- real testbed
HET_SCRIPT = """#!/bin/bash
#SBATCH --job-name=elastic-het-probe --output=/dev/null
#SBATCH --partition=gpu4 --nodes=2 --ntasks-per-node=4 --gres=gpu:4
#SBATCH hetjob
#SBATCH --partition=gpu2 --nodes=2 --ntasks-per-node=2 --gres=gpu:2
sleep 120
"""


def _running(slurm: SlurmCommands, job_id: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while slurm.job_info(job_id).state != "RUNNING":
        assert time.monotonic() < deadline, f"job {job_id} did not start: {slurm.job_info(job_id)}"
        time.sleep(0.2)


def _seen_gpus(slurm: SlurmCommands, job_id: int, group: int | None, nodes: int) -> dict[str, int]:
    """node -> GPUs one task per node of a step over `nodes` nodes of component `group` sees
    (CUDA_VISIBLE_DEVICES)."""
    cmd = ["srun", f"--jobid={job_id}", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}"]
    cmd += [f"--het-group={group}"] if group is not None else []
    run = subprocess.run(cmd + ["bash", "-c", 'echo "$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES"'],
                         env=slurm._env(), capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, f"{' '.join(cmd)}: {run.stderr}"
    return {line.split()[0]: len(line.split()[1].split(",")) for line in run.stdout.splitlines()}


def _scontrol(slurm: SlurmCommands, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["scontrol", *args], env=slurm._env(), capture_output=True, text=True, timeout=30)


@pytest.mark.slurm
@pytest.mark.slurm_core
def test_heterogeneous_job_on_the_real_testbed(uneven: Testbed) -> None:
    slurm = SlurmCommands(env=uneven.env())
    job = slurm.submit(HET_SCRIPT)
    companion = None
    try:
        _running(slurm, job)
        deadline = time.monotonic() + 30
        while len((alloc := slurm.allocation(job)).components) < 2:  # the leader may be RUNNING first
            assert time.monotonic() < deadline, f"component 1 of job {job} did not start: {alloc}"
            time.sleep(0.2)
        lead, comp = alloc.components
        assert (lead.offset, lead.job_id, lead.partition, lead.nodes, lead.gpus) == (0, job, "gpu4", ("n1", "n2"), (4, 4))
        assert (comp.offset, comp.partition, comp.nodes, comp.gpus) == (1, "gpu2", ("n3", "n4"), (2, 2))
        assert comp.job_id == job + 1 and comp.batch_host == "n3" and alloc.batch_host == lead.batch_host
        squeue = subprocess.run(["squeue", "--json"], env=slurm._env(), capture_output=True, text=True, check=True)
        assert parse_squeue_allocation(squeue.stdout, job) == alloc
        # the oracle: what steps of each component really get
        assert _seen_gpus(slurm, job, 0, 2) == {"n1": 4, "n2": 4}
        assert _seen_gpus(slurm, job, 1, 2) == {"n3": 2, "n4": 2}
        bare = subprocess.run(["srun", f"--jobid={job}", "--overlap", "--nodes=2", "true"], env=slurm._env(),
                              capture_output=True, text=True, timeout=30)  # no --het-group
        assert bare.returncode != 0 and "No directives to start application" in bare.stderr
        refused = subprocess.run(["srun", f"--jobid={comp.job_id}", "--overlap", "true"], env=slurm._env(),
                                 capture_output=True, text=True, timeout=30)
        assert refused.returncode != 0 and "not heterogeneous job leader" in refused.stderr
        # the leader component cannot be resized at all, not even down to its batch host
        with pytest.raises(SlurmError, match="not supported for job arrays"):
            slurm.shrink(job, [lead.batch_host])
        # another component: its batch host (first node) stays, the others can go
        with pytest.raises(SlurmError, match="Invalid node name"):
            slurm.shrink(comp.job_id, ["n4"])
        assert _scontrol(slurm, "update", f"JobId={job}+1", "NodeList=n3").returncode != 0  # no leader+offset form
        slurm.shrink(comp.job_id, ["n3"])
        assert slurm.allocation(job).gpus() == {"n1": 4, "n2": 4, "n3": 2}
        # a whole component goes with scancel <its id>; the job (its batch script) runs on
        slurm.cancel(comp.job_id)
        deadline = time.monotonic() + 30  # the component is listed (COMPLETING) until slurmd has ended it
        while len((after := slurm.allocation(job)).components) > 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [c.offset for c in after.components] == [0] and after.gpus() == {"n1": 4, "n2": 4}
        assert slurm.job_info(job).state == "RUNNING"
        # growing it back: a companion job shaped like the component (partition, GPUs per node)
        cmd = build_companion_command("elastic-het-probe", 1, 1, comp.gpus[0], comp.partition, after.nodes, "/dev/null")
        companion = slurm.submit(build_companion_script(job), extra_args=cmd[2:])
        _running(slurm, companion)
        grown = slurm.allocation(companion)
        assert grown.components[0].partition == "gpu2" and set(grown.gpus().values()) == {2}
        assert _seen_gpus(slurm, companion, None, 1) == grown.gpus()
    finally:
        for j in (companion, job):
            if j is not None:
                slurm.cancel(j)


@pytest.mark.slurm
def test_plain_job_on_uneven_nodes_on_the_real_testbed(uneven: Testbed) -> None:
    slurm = SlurmCommands(env=uneven.env())
    job = slurm.submit("#!/bin/bash\nsleep 120\n", extra_args=[
        "--job-name=elastic-uneven-probe", "--output=/dev/null", "--nodes=3", "--gpus=10", "--nodelist=n1,n2,n3"])
    try:
        _running(slurm, job)
        alloc = slurm.allocation(job)
        assert not alloc.heterogeneous and alloc.gpus() == {"n1": 4, "n2": 4, "n3": 2}
        squeue = subprocess.run(["squeue", "--json"], env=slurm._env(), capture_output=True, text=True, check=True)
        assert parse_squeue_allocation(squeue.stdout, job) == alloc  # the other format says the same
    finally:
        slurm.cancel(job)
