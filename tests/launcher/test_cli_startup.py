"""`elastic` and `elastic-launch` start without importing torch: the tests (and users' scripts) call them
many times, and importing torch costs 1.5-3 s of CPU on this machine each time. Only the commands that use
it (`elastic bench`, the launcher once it hosts the control plane) import it, when they run."""
import subprocess
import sys

import pytest

CHECK = "import sys; {code}; print(sorted(m for m in ('torch', 'scipy') if m in sys.modules))"


@pytest.mark.parametrize("code", [
    "from launcher.cli import build_parser; build_parser().parse_args(['jobs'])",  # every subcommand's parser
    "from launcher.cli import build_parser; build_parser().parse_args(['bench'])",
    "import launcher.launch",  # elastic-launch's parser and usage errors
])
def test_start_up_does_not_import_torch(code):
    out = subprocess.run([sys.executable, "-c", CHECK.format(code=code)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_bench_checks_a_scenario_name_without_importing_torch():
    """The check a mistyped --scenario goes through: migrate.scenarios, not migrate.bench (torch)."""
    code = "from launcher.cli import build_parser; build_parser().parse_args(['bench', '--scenario', 'pp4tp2-pp4tp4'])"
    out = subprocess.run([sys.executable, "-c", f"import sys; {code}; print('torch' in sys.modules)"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_bench_rejects_an_unknown_scenario_by_name():
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "bench", "--scenario", "pp1-pp2"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "invalid choice: 'pp1-pp2'" in out.stderr and "'pp4tp2-pp4tp4'" in out.stderr
