"""Checkpoint-restart baselines run end to end on a tiny model, with real spawned processes.

Each run spawns two small gloo worlds, so the tests are few and the model tiny: the point is
that both paths restore the old layout's state bit for bit after a PP and a TP change, and
that the verification would notice if they did not.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from migrate.baselines import BaselineResult, run_baseline
from migrate.layout import ModelSpec, ParallelConfig
from migrate.localrun import free_port
from migrate.train import TrainConfig

MODEL = ModelSpec(layers=4, hidden=64, heads=4, vocab=128, seq_len=16)
TC = TrainConfig(global_batch=4, micro_batch=1, seq_len=16)


def run(kind: str, prev: str, curr: str, tmp_path: Path, **kw) -> BaselineResult:
    return run_baseline(kind, MODEL, ParallelConfig.parse(prev), ParallelConfig.parse(curr), tc=TC,
                        workdir=tmp_path, port=free_port(), **kw)


def check_timings(r: BaselineResult) -> None:
    assert r.save_s > 0 and r.restart_s > 0 and r.load_s > 0
    assert r.total_s == pytest.approx(r.save_s + r.restart_s + r.load_s)
    assert r.bytes_written > MODEL.state_bytes // 2


@pytest.mark.parametrize("kind", ["torch_save", "dcp"])
def test_bit_exact_after_relayout(kind: str, tmp_path: Path) -> None:
    """PP2 -> TP2 changes both dimensions at once: layers regroup and every sharded tensor is re-split."""
    r = run(kind, "pp2tp1", "pp1tp2", tmp_path)
    assert r.kind == kind
    assert r.bit_exact, r.notes
    check_timings(r)
    if kind == "torch_save":  # the offline reshard writes a second full copy
        assert r.bytes_written > MODEL.state_bytes * 2
    else:
        assert r.bytes_written < MODEL.state_bytes * 1.3


def test_corruption_detected(tmp_path: Path) -> None:
    """One flipped bit of one Adam moment after the load makes the run not bit-exact.

    One process per world: this tests the check, not the reshard, and the machine is shared.
    """
    bad = run("dcp", "pp1", "pp1", tmp_path, corrupt=("exp_avg", "layers.1.mlp.fc1.weight"))
    assert not bad.bit_exact
    assert "exp_avg layers.1.mlp.fc1.weight unit" in bad.notes


def _hashes(prev: ParallelConfig, curr: ParallelConfig, cfg: ParallelConfig) -> dict[int, dict]:
    from migrate.baselines import unit_hashes
    from migrate.state import initial_state

    units = math.lcm(prev.tp, curr.tp)
    out = {}
    for rank in range(cfg.world_size):
        st = initial_state(MODEL, cfg, rank, seed=3)
        for kind in ("exp_avg", "exp_avg_sq"):  # distinct, non-zero moments
            for name, t in st.tensors[kind].items():
                t.copy_(st.tensors["param"][name] * (2 if kind == "exp_avg" else 3) + 1)
        hashes, problems = unit_hashes(MODEL, cfg, rank, st, units)
        out[rank] = {"hashes": hashes, "problems": problems, "step": 0, "opt_steps": {0.0}, "state": st}
    return out


def test_verify_units_without_processes() -> None:
    """The unit hashing agrees across layouts for a layout-independent state and catches a changed replica."""
    from migrate.baselines import _verify

    prev, curr = ParallelConfig.parse("pp2tp2"), ParallelConfig.parse("pp1tp1dp2")
    old, new = _hashes(prev, curr, prev), _hashes(prev, curr, curr)
    assert _verify(old, new) == (True, [])
    new[1]["state"].tensors["param"]["head.ln_f.weight"][3] += 1  # one DP replica of a replicated tensor
    from migrate.baselines import unit_hashes

    new[1]["hashes"], _ = unit_hashes(MODEL, curr, 1, new[1]["state"], 2)
    ok, problems = _verify(old, new)
    assert not ok and any("head.ln_f.weight" in p for p in problems)
    del new[0]["state"].tensors["exp_avg"]["embed.wte.weight"]
    new[0]["hashes"], new[0]["problems"] = unit_hashes(MODEL, curr, 0, new[0]["state"], 2)
    ok, problems = _verify(old, {0: new[0]})
    assert not ok and any("lacks exp_avg embed.wte.weight" in p for p in problems)
