"""A task of a node's step that dies while the others run on is seen at once: srun says so on stderr
("srun: error: n1: task 1: Killed") and the Slurm backend turns that into the device's exit status."""
from __future__ import annotations

import os
import time

import pytest

from launcher.backends.slurm.nodes import SlurmNodes
from launcher.backends.slurm.client import SlurmCommands
from launcher.backends.slurm.parse import JobInfo, parse_task_end


@pytest.mark.parametrize("line, want", [
    ("srun: error: n1: task 0: Killed", ("n1", [0], 137)),
    ("srun: error: gpu07: tasks 0-1,3: Exited with exit code 3", ("gpu07", [0, 1, 3], 3)),
    ("srun: error: n2: task 1: Segmentation fault (core dumped)", ("n2", [1], 139)),
    ("srun: error: n1: tasks 0,2: Terminated", ("n1", [0, 2], 143)),
    ("srun: Force Terminated StepId=47.0", None),
    ("srun: error: Unable to create step for job 5: Requested nodes are busy", None),
])
def test_parse_task_end(line, want) -> None:
    assert parse_task_end(line) == want


def test_a_dead_task_shows_while_its_step_runs(tmp_path) -> None:
    fake_srun = tmp_path / "srun"
    fake_srun.write_text("#!/bin/sh\necho 'srun: error: n2: task 1: Killed' >&2\nsleep 30\n")
    fake_srun.chmod(0o755)
    commands = SlurmCommands(env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    backend = SlurmNodes(commands, 5, 2, info=JobInfo(5, "RUNNING", ["n1", "n2"], "n1", 2), log_dir=tmp_path)
    h = backend.start("n2", 1, {"K": "v"}, ["prog"])
    try:
        deadline = time.monotonic() + 10
        while not h.exited() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.exited() == {3: 137} and h.step.poll() is None
    finally:
        h.kill()
    assert h.exited() == {2: h.step.returncode, 3: 137}
    assert "task 1: Killed" in (tmp_path / "step-n2.log").read_text()


@pytest.mark.parametrize("status, other", [(137, 0), (1, 1)])
def test_a_step_that_ends_after_a_task_died(tmp_path, status, other) -> None:
    """srun exits with its worst task's status: when the task it reported explains it, the other task
    ended cleanly (its worker finished); a status no report explains is the other task's too."""
    fake_srun = tmp_path / "srun"
    fake_srun.write_text(f"#!/bin/sh\necho 'srun: error: n2: task 1: Killed' >&2\nsleep 0.3\nexit {status}\n")
    fake_srun.chmod(0o755)
    commands = SlurmCommands(env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    backend = SlurmNodes(commands, 5, 2, info=JobInfo(5, "RUNNING", ["n1", "n2"], "n1", 2), log_dir=tmp_path)
    h = backend.start("n2", 1, {"K": "v"}, ["prog"])
    assert h.wait(10)
    assert h.exited() == {2: other, 3: 137}
