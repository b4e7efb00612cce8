"""launcher.runtime.threads against real gloo process groups, each test in a fresh interpreter (a thread's
priority cannot be raised back): lower() puts every gloo I/O thread, and only those, at the niceness asked
for, a group made later is caught by the next call, a second call changes nothing, and niceness 0 leaves
every thread alone. $ELASTIC_GLOO_NICE is read with a clear error for what it cannot be. The live check
(every worker's gloo threads lowered in every step, across migrations) is tests/examples/test_gpt_runtime.py;
the refusal of a worker given a bad value, tests/launcher/runtime/test_worker_flags.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.runtime.threads import DEFAULT_NICE, ENV_GLOO_NICE, nice_from_env

from tests.paths import ROOT

SCRIPT = r"""
import json, os, sys
import torch.distributed as dist
from launcher.runtime.threads import GlooThreads, THREAD_NAME, thread_nice

def threads():
    out = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            out.append((f.read().strip(), thread_nice(int(tid))))
    return sorted(out)

store = dist.FileStore(sys.argv[1], 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
g = GlooThreads(int(sys.argv[2]))
before = threads()
first = g.lower()
after_first = threads()
again = g.lower()
dist.new_group([0])  # a group made later: its own I/O thread
made = threads()
later = g.lower()
print(json.dumps({"before": before, "first": first, "after_first": after_first, "again": again,
                  "made": made, "later": later, "end": threads()}))
"""


def _run(tmp_path: Path, nice: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "store"), str(nice)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gloo(threads: list) -> list[int]:
    return [nice for name, nice in threads if name == "gloo_tcp_loop"]


def test_every_gloo_thread_and_only_those_is_lowered_including_a_group_made_later(tmp_path: Path) -> None:
    r = _run(tmp_path, DEFAULT_NICE)
    assert _gloo(r["before"]) and set(_gloo(r["before"])) == {0}, r["before"]  # gloo made them at the default
    assert r["first"] == len(_gloo(r["before"]))
    assert set(_gloo(r["after_first"])) == {DEFAULT_NICE}
    assert all(nice == 0 for name, nice in r["after_first"] if name != "gloo_tcp_loop"), r["after_first"]
    assert r["again"] == 0  # nothing new: nothing changed
    assert len(_gloo(r["made"])) > len(_gloo(r["after_first"])) and 0 in _gloo(r["made"]), r["made"]
    assert r["later"] == len(_gloo(r["made"])) - len(_gloo(r["after_first"]))
    assert set(_gloo(r["end"])) == {DEFAULT_NICE}


def test_niceness_zero_leaves_every_thread_alone(tmp_path: Path) -> None:
    r = _run(tmp_path, 0)
    assert r["first"] == r["again"] == r["later"] == 0
    assert all(nice == 0 for _name, nice in r["end"]) and _gloo(r["end"]), r["end"]


@pytest.mark.parametrize("raw, nice", [(None, DEFAULT_NICE), ("", DEFAULT_NICE), (" 7 ", 7), ("0", 0), ("19", 19)])
def test_the_niceness_comes_from_the_environment(raw: str | None, nice: int) -> None:
    assert nice_from_env({} if raw is None else {ENV_GLOO_NICE: raw}) == nice


@pytest.mark.parametrize("raw", ["20", "-1", "low", "1.5"])
def test_a_niceness_outside_0_to_19_is_refused_with_what_is_allowed(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"\$ELASTIC_GLOO_NICE must be a whole number from 0 .* to 19 .*got '{raw}'"):
        nice_from_env({ENV_GLOO_NICE: raw})
