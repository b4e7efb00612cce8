"""The Slurm backend on a heterogeneous job and on uneven nodes, against a scripted Slurm (no cluster).

Allocations are the ones recorded on the testbed (tests/launcher/golden/hetjob_*, uneven_*). The
expected srun/scontrol/scancel lines are written out by hand from what Slurm 22.05 was seen to
accept (docs/reference/slurm.md, "Heterogeneous jobs"); the real testbed runs them in test_slurm_hetjob.py.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from launcher.backends.slurm.allocation import Allocation, Component, parse_show_job_detail
from launcher.backends.slurm.nodes import SlurmNodes
from launcher.backends.slurm.client import SlurmCommands
from launcher.backends.slurm.parse import JobInfo
from launcher.backends.slurm.holdings import COMPANION, COMPONENT, LEADER, Holder, companion_shape, plan_release

from tests.launcher.test_launch import only_reads
from tests.paths import GOLDEN
# component 0: n1 (4 GPUs, gpu4), component 1: n3, n4 (2 GPUs each, gpu2); leader id 19, component 1 is job 20
HET = parse_show_job_detail((GOLDEN / "hetjob_show_job_d.txt").read_text())
# the same with a leader of two nodes
HET2 = Allocation(19, (Component(0, 19, ("n1", "n2"), (4, 4), "gpu4", "n1"), Component(1, 20, ("n3", "n4"), (2, 2), "gpu2", "n3")))


class Recorder:
    """Slurm that accepts every change and records it; companion jobs get ids from 31 on."""

    def __init__(self, release: str = "22.05.8") -> None:
        self.calls: list[list[str]] = []
        self.release = release

    def __call__(self, cmd, *, input=None, env=None, timeout=None):
        self.calls.append(list(cmd))
        out = "31\n" if cmd[0] == "sbatch" else f"slurm {self.release}\n" if cmd[:2] == ["scontrol", "--version"] else ""
        return subprocess.CompletedProcess(cmd, 0, out, "")

    def changes(self) -> list[list[str]]:
        return [c for c in self.calls if c[0] == "scancel" or c[:2] == ["scontrol", "update"]]


def backend(alloc: Allocation, gpn: int = 4, release: str = "22.05.8") -> tuple[SlurmNodes, Recorder]:
    slurm = Recorder(release)
    lead = alloc.component(0)
    info = JobInfo(alloc.job_id, "RUNNING", list(lead.nodes), lead.batch_host, len(lead.nodes), partition=lead.partition)
    return SlurmNodes(SlurmCommands(runner=slurm), alloc.job_id, gpn, info=info, allocation=alloc), slurm


def test_heterogeneous_job_steps_name_the_leader_and_the_component() -> None:
    nodes, _ = backend(HET)
    assert nodes.allocation() == ["n1", "n3", "n4"] and nodes.batch_node == "n1"
    assert [(nodes.gpus_on(n), nodes.first_device(n), nodes.component_of(n)) for n in nodes.allocation()] == [
        (4, 0, 0), (2, 4, 1), (2, 6, 1)]
    (cmd,) = nodes.commands_for_start("n4", 2, {"A": "1"}, ["prog"])
    assert cmd[:10] == ["srun", "--jobid=19", "--het-group=1", "--nodes=1", "--nodelist=n4", "--ntasks-per-node=2",
                        "--ntasks=2", "--gres=gpu:2", "--overlap", "--kill-on-bad-exit=0"]
    assert "ELASTIC_FIRST_DEVICE=6" in cmd and "ELASTIC_GPUS_PER_NODE=2" in cmd and cmd[-1] == "prog"
    (lead,) = nodes.commands_for_start("n1", 0, {}, ["prog"])
    assert lead[1:3] == ["--jobid=19", "--het-group=0"] and "--gres=gpu:4" in lead
    assert "component 1 (Slurm job 20): n3(2),n4(2)" in nodes.describe()


def test_gpus_per_node_caps_the_workers_of_a_node() -> None:
    nodes, _ = backend(HET, gpn=2)
    assert [nodes.gpus_on(n) for n in nodes.allocation()] == [2, 2, 2]


@pytest.mark.parametrize("release, big_gpus, small_gpus", [
    ("22.05.8", "--gpus=4", "--gpus=2"),  # 22.05 refuses --gres=gpu:4 above the job's smallest share
    ("24.11.5", "--gres=gpu:4", "--gres=gpu:2"),  # 24.11 starts --gpus steps only one at a time
    ("26.05.5", "--gres=gpu:4", "--gres=gpu:2"),
])
def test_plain_job_on_uneven_nodes_asks_each_step_for_its_nodes_gpus(release, big_gpus, small_gpus) -> None:
    alloc = parse_show_job_detail((GOLDEN / "uneven_exclusive_show_job_d.txt").read_text())
    nodes, slurm = backend(alloc, release=release)
    assert [nodes.gpus_on(n) for n in nodes.allocation()] == [4, 4, 2, 2] and nodes.component_of("n3") == 0
    assert [nodes.first_device(n) for n in nodes.allocation()] == [0, 4, 8, 10]
    big, small = (nodes.commands_for_start(n, i, {}, ["p"])[0] for n, i in (("n1", 0), ("n3", 2)))
    assert big_gpus in big and small_gpus in small
    assert len([c for c in big + small if c.startswith(("--gpus", "--gres"))]) == 2
    assert "--het-group" not in " ".join(big)
    assert nodes.release(["n1", "n2", "n3"]) == []  # a plain job shrinks as before, without notes
    assert slurm.changes() == [["scontrol", "update", "JobId=22", "NodeList=n[1-3]"]]
    # a grow asks for a node like the one it lost: 2 GPUs, the job's partition
    cmd, _script = nodes.companion_command("t", 1, 1, ["n1", "n2", "n3"])
    assert "--gres=gpu:2" in cmd and "--ntasks-per-node=2" in cmd and "--partition=debug" in cmd


def test_shrinking_a_component_then_releasing_it_whole() -> None:
    nodes, slurm = backend(HET)
    assert nodes.commands_for_release(["n1", "n3"]) == [["scontrol", "update", "JobId=20", "NodeList=n3"]]
    assert nodes.release(["n1", "n3"]) == ["component 1 (Slurm job 20): n4 released (scontrol update)"]
    assert not nodes.holds("n4") and nodes.allocation() == ["n1", "n3"]
    assert nodes.release(["n1"]) == ["component 1 (Slurm job 20) cancelled: n3 released"]
    assert slurm.changes() == [["scontrol", "update", "JobId=20", "NodeList=n3"], ["scancel", "20"]]
    assert nodes.allocation() == ["n1"] and nodes.component_of("n3") == 0


def test_the_leader_component_cannot_shrink_its_nodes_stay_idle() -> None:
    nodes, slurm = backend(HET2)
    assert [nodes.keep_rank(n) for n in ("n1", "n2", "n3", "n4")] == [0, 0, 1, 2]  # what cannot go is kept first
    notes = nodes.release(["n1", "n3", "n4"])
    assert notes == ["component 0 (Slurm job 19): Slurm cannot resize a heterogeneous job's leader component; "
                     "n2 stays allocated, idle"]
    assert slurm.changes() == [] and nodes.holds("n2") and nodes.allocation() == ["n1", "n2", "n3", "n4"]
    assert nodes.release(["n1", "n3"]) == ["component 1 (Slurm job 20): n4 released (scontrol update)"]  # said once


def test_a_components_batch_host_goes_only_with_the_component() -> None:
    nodes, slurm = backend(HET)
    notes = nodes.release(["n1", "n4"])
    assert notes == ["component 1 (Slurm job 20): its batch host n3 goes only with the whole job; "
                     "it stays allocated, idle"]
    assert slurm.changes() == [] and nodes.holds("n3")


def test_grow_extends_the_component_that_lost_nodes_with_a_companion_like_it() -> None:
    nodes, slurm = backend(HET2)
    nodes.release(["n1", "n2", "n3"])  # component 1 loses n4
    shape = nodes.shape()
    assert (shape.component, shape.partition, shape.gpus) == (1, "gpu2", 2)
    cmd, _script = nodes.companion_command("het", 1, 1, ["n1", "n2", "n3"])
    for flag in ("--partition=gpu2", "--nodes=1", "--gres=gpu:2", "--ntasks-per-node=2", "--exclude=n[1-3]"):
        assert flag in cmd
    nodes.adopt_companion(31, ["n4"], "n4")
    assert (nodes.component_of("n4"), nodes.gpus_on("n4"), nodes.first_device("n4")) == (1, 2, 10)  # its old numbers
    (step,) = nodes.commands_for_start("n4", 3, {}, ["p"])
    assert step[1:3] == ["--jobid=31", "--nodes=1"] and "--gres=gpu:2" in step
    assert nodes.release(["n1", "n2", "n3"]) == ["companion job 31 cancelled (component 1)"]
    assert slurm.changes()[-1] == ["scancel", "31"] and nodes.companion_jobs() == []


# ---------------------------------------------------------------------- the pure parts alone
def _holders() -> list[Holder]:
    return [Holder(19, LEADER, ("n1", "n2"), "n1", "gpu4", 0, 19, 0),
            Holder(20, COMPONENT, ("n3", "n4"), "n3", "gpu2", 1, 19, 1)]


@pytest.mark.parametrize("keep, shrink, cancel, idle", [
    (["n1", "n2", "n3", "n4"], (), (), ()),
    (["n1", "n2", "n3"], ((20, ("n3",)),), (), ()),
    (["n1", "n2"], (), (20,), ()),
    (["n1"], (), (20,), ("n2",)),
    (["n1", "n2", "n4"], (), (), ("n3",)),
])
def test_plan_release(keep, shrink, cancel, idle) -> None:
    p = plan_release(_holders(), keep)
    assert (p.shrink, p.cancel, p.idle) == (shrink, cancel, idle)
    assert len(p.notes) == len(shrink) + len(cancel) + len(idle)


def test_companion_shape_follows_the_component_that_lost_most() -> None:
    start = _holders()
    gpus = {"n1": 4, "n2": 4, "n3": 2, "n4": 2, "n5": 2}
    assert companion_shape(start, start, gpus).component == 1  # nothing lost: the last component
    lost_lead = [Holder(19, LEADER, ("n1",), "n1", "gpu4", 0), start[1]]
    shape = companion_shape(start, lost_lead, gpus)
    assert (shape.component, shape.partition, shape.gpus) == (0, "gpu4", 4)
    back = [start[0], Holder(20, COMPONENT, ("n3",), "n3", "gpu2", 1), Holder(31, COMPANION, ("n5",), "n5", "gpu2", 1)]
    assert companion_shape(start, back, gpus).component == 1  # its companion made up for it: nothing lost


# ---------------------------------------------------------------------- elastic-launch in such a job
@pytest.fixture
def het_slurm(monkeypatch):
    """Slurm that knows heterogeneous job 19 (the recorded one) and nothing else; changes nothing."""
    from launcher.backends.slurm import select as slurm_client

    text = (GOLDEN / "hetjob_show_job_d.txt").read_text()
    calls = []

    def runner(cmd, *, input=None, env=None, timeout=None):
        calls.append(list(cmd))
        if [c for c in cmd if c != "-d"] == ["scontrol", "show", "job", "19"]:
            return subprocess.CompletedProcess(cmd, 0, text, "")
        return subprocess.CompletedProcess(cmd, 1, "", f"unexpected {cmd}\n")

    monkeypatch.setattr(slurm_client, "select_backend", lambda *a, **k: SlurmCommands(runner=runner))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return calls


def test_dry_run_in_a_heterogeneous_job(het_slurm, capsys, tmp_path) -> None:
    from launcher.launch import main

    assert main(["--dry-run", "--backend", "slurm", "--job-id", "19", "--nnodes", "2:3", "--gpus-per-node", "4",
                 "--layouts", "pp4tp2,pp2tp2", "--db", f"sqlite:///{tmp_path}/e.db", "--master-addr", "10.0.0.1",
                 "--", "python", "-m", "launcher.worker", "--layers", "4"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("srun")]
    assert [x.split()[1:3] for x in lines] == [["--jobid=19", "--het-group=0"], ["--jobid=19", "--het-group=1"],
                                              ["--jobid=19", "--het-group=1"]]
    assert [x.split("ELASTIC_FIRST_DEVICE=")[1].split()[0] for x in lines] == ["0", "4", "6"]
    assert all(only_reads(c) for c in het_slurm)


def test_layouts_that_do_not_fit_the_allocations_nodes_are_one_line(het_slurm, capsys, tmp_path) -> None:
    from launcher.launch import main

    assert main(["--dry-run", "--backend", "slurm", "--job-id", "19", "--nnodes", "2:3", "--gpus-per-node", "4",
                 "--layouts", "pp1tp4", "--db", f"sqlite:///{tmp_path}/e.db",  # fits 4-GPU nodes, not 2-GPU ones
                 "--", "python", "-m", "launcher.worker", "--layers", "4", "--hidden", "256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "on the allocation's nodes" in err and "n3(2)" in err, err
