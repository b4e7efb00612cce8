"""launcher.runtime.torchrun_exec, the wrapper every worker of a node starts through (srun's tasks, the local
backend's first start): a worker that aborts in C code says where in its output, unless the user turned that
off. Real processes: the wrapper execs a real interpreter that aborts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

ABORTS = "import os\n\ndef deep_in_the_script():\n    os.abort()\n\ndeep_in_the_script()\n"


@pytest.mark.parametrize("users_setting, says_where", [(None, True), ("", False)])
def test_a_worker_that_aborts_prints_its_python_stack_unless_the_user_said_not_to(
        tmp_path: Path, users_setting: str | None, says_where: bool) -> None:
    script = tmp_path / "aborts.py"
    script.write_text(ABORTS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    if users_setting is not None:
        env["PYTHONFAULTHANDLER"] = users_setting
    run = subprocess.run([sys.executable, "-m", "launcher.runtime.torchrun_exec", "--", "python", str(script)],
                         env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGABRT
    assert ("Fatal Python error: Aborted" in run.stderr and "in deep_in_the_script" in run.stderr) == says_where, \
        run.stderr
