"""`elastic` and `elastic-launch` start without importing torch: the tests (and users' scripts) call them
many times, and importing torch costs 1.5-3 s of CPU on this machine each time. Only the commands that use
it (`elastic bench`, the launcher once it hosts the control plane) import it, when they run. Likewise a
training worker does not import scipy (the planner's solver, ~0.5 s of CPU per process here): the launcher
plans, the workers only move and train, and a job starts many of them at once on shared cores."""
import subprocess
import sys

import pytest

CHECK = "import sys; {code}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
PARSE = "from launcher.cli import build_parser; build_parser().parse_args({argv!r})"


@pytest.mark.parametrize("code,heavy", [
    (PARSE.format(argv=["jobs"]), ("torch", "scipy")),  # every subcommand's parser
    (PARSE.format(argv=["bench"]), ("torch", "scipy")),
    ("import launcher.launch", ("torch", "scipy")),  # elastic-launch's parser and usage errors
    # the check a mistyped --scenario goes through: migrate.scenarios (the migrate package), not torch
    (PARSE.format(argv=["bench", "--scenario", "pp4tp2-pp4tp4"]), ("torch", "scipy")),
    # what the reference worker imports to train and to take part in migrations (launcher.worker.train,
    # launcher.runtime's reshard), and the planning modules the migrate package brings with it
    ("import launcher.worker, launcher.runtime, migrate.train, migrate.gpt_live, migrate.reshard, migrate.warmup, "
     "migrate.plan, migrate.pairing, migrate.allocator", ("scipy",)),
], ids=["elastic-jobs", "elastic-bench", "elastic-launch", "bench-scenario-name", "worker"])
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
