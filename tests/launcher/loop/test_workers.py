"""What the launcher says of workers that died: the signal that killed one is named (Popen's negative code),
a script's own exit code is left as it is."""
from __future__ import annotations

from launcher.loop.workers import exit_codes


def test_a_worker_killed_by_a_signal_is_named_and_a_scripts_own_exit_code_is_not() -> None:
    assert exit_codes({1: -6}) == "exit codes [-6] (SIGABRT: an abort in C code)"
    assert exit_codes({2: -9, 3: 1, 0: 1}) == "exit codes [-9, 1] (SIGKILL: killed, e.g. out of memory)"
    assert exit_codes({0: 1, 1: 2}) == "exit codes [1, 2]"
    assert exit_codes({0: -15}) == "exit codes [-15] (SIGTERM)"
    assert exit_codes({0: -200}) == "exit codes [-200]"  # no such signal: the code alone
