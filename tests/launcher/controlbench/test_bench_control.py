"""`elastic bench-control`: the store traffic of a live step does not grow with the job (counted, not timed),
and the command's figures are what its model says they are."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launcher.controlbench import store_share
from launcher.controlbench.report import combine


def elastic(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=600)


def test_rank_0_pays_the_same_store_operations_a_step_at_8_and_at_128_ranks_and_the_others_none():
    small, large = (store_share.measure(n, seconds=2.0, processes=2, say=lambda m: None) for n in (8, 128))
    for got in (small, large):
        assert got["steps"] > 200  # thousands of steps a second with no compute
        assert 4 <= got["rank0_store_ops_per_step"] < 5.5  # drop, settle, event check, stamp; its heartbeat
        assert got["other_rank_store_ops_per_s"] < 3  # one heartbeat a second, not one per step
        assert got["launcher_store_ops_per_poll"] == 4  # the step keys in one multi_get, suspicions, the loss
        assert got["event_to_rank0_ms"]["events"] >= 3
        assert got["failure_settled_ms"] is not None  # every survivor settled its step
    assert abs(small["rank0_store_ops_per_step"] - large["rank0_store_ops_per_step"]) < 0.5


def _store(n):
    return {"ranks": n, "steps": 100, "store_step_ms": {"median": 0.2, "p90": 0.3, "max": 2.0},
            "rank0_store_ops_per_step": 5.0, "other_rank_store_ops_per_s": 1.0, "launcher_store_ops_per_poll": 4,
            "event_to_rank0_ms": {"median": 0.5, "max": 3.0, "events": 10}, "failure_settled_ms": 100.0,
            "failure_store_burst_ms": 150.0, "server_cpu_share": 0.3}


def test_the_figures_at_n_add_2_log2_n_hops_to_the_store_share():
    pair = {"processes": 2, "vote_ms": {"median": 0.4, "p90": 0.5, "max": 1.0}, "hop_ms": 0.1,
            "event_to_agreement_ms": {"median": 0.6, "max": 1.0}, "failure_to_abort_ms": 10.0}
    out = combine(_store(1024), [pair])
    assert out["model"]["rounds"] == 10
    assert out["per_step_ms"]["median"] == pytest.approx(0.2 + 20 * 0.1)
    assert out["event_to_agreement_ms"] == pytest.approx(0.5 + 10 * 0.1)
    assert out["failure_to_abort_ms"] == pytest.approx(100.0 + 10 * 10.0)
    assert combine(_store(4096), [pair])["per_step_ms"]["median"] == pytest.approx(0.2 + 24 * 0.1)


def test_the_command_prints_its_figures_as_json():
    run = elastic("bench-control", "--ranks", "16", "--seconds", "2", "--groups", "2", "--processes", "2", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["ranks"] == 16 and out["model"]["rounds"] == 4
    assert [g["processes"] for g in out["groups"]] == [2]
    assert out["groups"][0]["failure_to_abort_ms"] is not None  # the killed rank's peer abandoned its step
    assert out["per_step_ms"]["median"] > 0


@pytest.mark.parametrize("args, says", [
    (("--ranks", "1"), "--ranks 1: from 2 to"),
    (("--groups", "x"), "--groups 'x': give process counts"),
    (("--groups", "1"), "sizes from 2 to 64"),
    (("--seconds", "1"), "--seconds: at least 2"),
])
def test_bad_input_is_refused_before_anything_starts(args, says):
    run = elastic("bench-control", *args)
    assert run.returncode == 2 and says in run.stderr


def test_live_mode_s_step_is_compared_with_the_same_step_with_no_runtime():
    from launcher.controlbench.steady import PLAIN, live_over_plain

    runs = [{"job": "examples/mixer_live.py, tp2dp2", "step_ms": 25.0, "error": None},
            {"job": PLAIN, "step_ms": 20.0, "error": None}]
    assert live_over_plain(runs) == pytest.approx(0.25)
    assert live_over_plain(runs[:1]) is None and live_over_plain([runs[0], {**runs[1], "error": "exited 1"}]) is None
