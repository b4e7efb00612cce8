"""What the launcher says of workers that died: the signal that killed one is named, as each backend reports
it (the local backend -N, srun 128+N), a script's own exit code is left as it is."""
from __future__ import annotations

from launcher.backends.slurm.parse import parse_task_end
from launcher.loop.workers import exit_codes


def test_a_worker_killed_by_a_signal_is_named_and_a_scripts_own_exit_code_is_not() -> None:
    assert exit_codes({1: -6}) == "exit codes [-6] (SIGABRT: an abort in C code)"
    assert exit_codes({2: -9, 3: 1, 0: 1}) == \
        "exit codes [-9, 1] (SIGKILL: killed (out of memory, a lost node, or a kill))"
    assert exit_codes({0: 1, 1: 2}) == "exit codes [1, 2]"
    assert exit_codes({0: -15}) == "exit codes [-15] (SIGTERM)"
    assert exit_codes({0: -200, 1: 128, 2: 200}) == "exit codes [-200, 128, 200]"  # no such signal: the code alone


def test_a_slurm_task_that_aborted_is_named_as_on_the_local_backend() -> None:
    _node, tasks, code = parse_task_end("srun: error: n1: task 1: Aborted (core dumped)")
    assert tasks == [1] and exit_codes({1: code}) == "exit codes [134] (SIGABRT: an abort in C code)"
    _node, _tasks, code = parse_task_end("srun: error: n2: tasks 0-1: Exited with exit code 3")
    assert exit_codes({0: code}) == "exit codes [3]"
