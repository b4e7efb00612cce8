"""Signalling a node's workers on Slurm goes through slurmctld (`scancel --signal=SIG JOB.STEP`), not
through srun: srun answers SIGTERM by SIGKILLing its tasks (measured on the testbed), which would break
restart mode's SIGTERM-then-wait contract. Against a scripted runner; the real path runs in
tests/examples/test_slurm_examples.py (a DDP script checkpoints on the SIGTERM and resumes there)."""
from __future__ import annotations

import signal
import subprocess

import pytest

from launcher.backends.base import NodeHandle
from launcher.backends.slurm.nodes import SlurmNodes
from launcher.backends.slurm.client import SlurmCommands, SlurmError
from launcher.backends.slurm.commands import build_steps_command
from launcher.backends.slurm.parse import JobInfo, parse_step_on_node

# what `squeue --steps --jobs=211 --noheader --format=%i %N` prints on the testbed (format as captured
# there): a restart on n1 (step 4 replaced step 0, still listed while it ends), the batch and extern
# steps, and a step over two nodes in hostlist form
STEPS = """211.0 n1
211.1 n2
211.batch n1
211.extern n[1-4]
211.4 n1
211.7 n[3-4]
"""


@pytest.mark.parametrize("node, want", [("n1", "211.4"), ("n2", "211.1"), ("n4", "211.7"), ("n9", None)])
def test_the_newest_worker_step_on_a_node(node, want) -> None:
    assert parse_step_on_node(STEPS, node) == want


def test_no_worker_step_listed() -> None:
    assert parse_step_on_node("211.batch n1\n211.extern n1\n", "n1") is None
    assert parse_step_on_node("", "n1") is None


def test_steps_command() -> None:
    assert build_steps_command(211) == ["squeue", "--steps", "--jobs=211", "--noheader", "--format=%i %N"]


class Runner:
    """Scripted Slurm: squeue lists STEPS; scancel answers with `scancel_rc` / `scancel_err`."""

    def __init__(self, scancel_rc: int = 0, scancel_err: str = "", steps: str = STEPS) -> None:
        self.calls: list[list[str]] = []
        self.scancel_rc, self.scancel_err, self.steps = scancel_rc, scancel_err, steps

    def __call__(self, cmd, *, input=None, env=None, timeout=None):
        cmd = list(cmd)
        self.calls.append(cmd)
        if cmd[0] == "squeue":
            return subprocess.CompletedProcess(cmd, 0, self.steps, "")
        if cmd[0] == "scancel":
            return subprocess.CompletedProcess(cmd, self.scancel_rc, "", self.scancel_err)
        return subprocess.CompletedProcess(cmd, 1, "", f"unexpected {cmd}")


def test_signal_goes_to_the_step_through_scancel() -> None:
    runner = Runner()
    assert SlurmCommands(runner=runner).signal_step_on(211, "n1", signal.SIGTERM) == "211.4"
    assert runner.calls[-1] == ["scancel", "--signal=TERM", "211.4"]


def test_scancels_invalid_job_id_answer_counts_as_delivered() -> None:
    # Slurm 22.05: exit 225 and this line, while the step's tasks did get the signal (measured)
    runner = Runner(225, "scancel: error: Kill job error on job step id 211: Invalid job id specified\n")
    assert SlurmCommands(runner=runner).signal_step_on(211, "n2", "TERM") == "211.1"


def test_other_scancel_errors_are_raised() -> None:
    with pytest.raises(SlurmError, match="Access/permission denied"):
        SlurmCommands(runner=Runner(1, "scancel: error: Access/permission denied\n")).signal_step_on(211, "n2", 15)


class FakeSrun:
    """An srun process that is still running, recording the signals sent to it."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def poll(self):
        return None

    def send_signal(self, sig: int) -> None:
        self.sent.append(sig)


def _nodes(runner: Runner) -> tuple[SlurmNodes, NodeHandle, FakeSrun]:
    info = JobInfo(job_id=211, state="RUNNING", nodes=["n1", "n2"], batch_host="n1", num_nodes=2)
    nodes = SlurmNodes(SlurmCommands(runner=runner), 211, 2, info=info)
    srun = FakeSrun()
    return nodes, NodeHandle("n2", [2, 3], step=srun), srun


def test_backend_signal_reaches_the_tasks_not_srun() -> None:
    runner = Runner()
    nodes, handle, srun = _nodes(runner)
    nodes.signal(handle, signal.SIGTERM)
    assert runner.calls[-1] == ["scancel", "--signal=TERM", "211.1"] and srun.sent == []


def test_a_step_slurm_does_not_list_yet_is_signalled_through_srun() -> None:
    nodes, handle, srun = _nodes(Runner(steps="211.batch n1\n"))
    nodes.signal(handle, signal.SIGTERM)
    assert srun.sent == [signal.SIGTERM]


def test_when_slurmctld_does_not_answer_srun_gets_the_signal(capsys) -> None:
    nodes, handle, srun = _nodes(Runner(1, "scancel: error: Unable to contact slurm controller\n"))
    nodes.signal(handle, signal.SIGTERM)
    assert srun.sent == [signal.SIGTERM]
    assert "through Slurm failed" in capsys.readouterr().err
