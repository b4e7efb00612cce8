"""`elastic` and `elastic-launch` start without importing torch: the tests (and users' scripts) call them
many times, and importing torch costs 1.5-3 s of CPU on this machine each time. Only the commands that use
it (`elastic bench`, the launcher once it hosts the control plane) import it, when they run."""
import subprocess
import sys

import pytest

CHECK = "import sys; {code}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
PARSE = "from launcher.cli import build_parser; build_parser().parse_args({argv!r})"


@pytest.mark.parametrize("code,heavy", [
    (PARSE.format(argv=["jobs"]), ("torch", "scipy")),  # every subcommand's parser
    (PARSE.format(argv=["bench"]), ("torch", "scipy")),
    ("import launcher.launch", ("torch", "scipy")),  # elastic-launch's parser and usage errors
    # the check a mistyped --scenario goes through: migrate.scenarios (the migrate package: scipy), not torch
    (PARSE.format(argv=["bench", "--scenario", "pp4tp2-pp4tp4"]), ("torch",)),
], ids=["elastic-jobs", "elastic-bench", "elastic-launch", "bench-scenario-name"])
def test_start_up_does_not_import_torch(code, heavy):
    out = subprocess.run([sys.executable, "-c", CHECK.format(code=code, heavy=heavy)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_bench_rejects_an_unknown_scenario_by_name():
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "bench", "--scenario", "pp1-pp2"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "invalid choice: 'pp1-pp2'" in out.stderr and "'pp4tp2-pp4tp4'" in out.stderr
