"""Optimizers other than Adam across live migrations (tests/examples/schedule_script.py --optimizer under
`elastic-launch --backend local`): tp2dp2 shrunk to tp2dp1 and grown back, each optimizer chosen for the state
it keeps besides Adam's (ASGD: scalar tensors `eta` and `mu` beside `step`; NAdam: the scalar `mu_product`;
RMSprop centered with momentum: three tensors shaped like the parameter). Its gradients are clipped by
`job.clip_grad_norm_` on the TP x DP layouts.

Oracles: the script saves the whole state (full tensors) before and after every step; across each migration
the state before step S+1 on the new layout is the state after step S on the old one, bit for bit, with the
optimizer's own keys in it. The clipped norm each step logs equals torch.nn.utils.clip_grad_norm_'s on one
unsharded model holding the state of before that step and the step's whole batch."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.examples.harness import ROOT, assert_state_carried, shrink_and_grow

SCRIPT = "../tests/examples/schedule_script.py"  # run_local runs examples/<script>
STEPS = 40
KEYS = {"ASGD": {"ax", "eta", "mu", "step"}, "NAdam": {"exp_avg", "exp_avg_sq", "mu_product", "step"},
        "RMSprop": {"grad_avg", "momentum_buffer", "square_avg", "step"}}


def _script():
    spec = importlib.util.spec_from_file_location("schedule_script", ROOT / "tests" / "examples" / "schedule_script.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _unsharded_norm(script, before: dict[str, torch.Tensor], step: int) -> float:
    """The gradient norm of the whole model on step `step`'s whole batch (what the DP mean of equal shards is)."""
    model = script.model(None)
    model.load_state_dict({k: v for k, v in before.items() if not k.startswith("optim.")})
    x, y = script.batch(step, 0, 1)
    nn.functional.mse_loss(model(x), y).backward()
    return float(nn.utils.clip_grad_norm_(model.parameters(), 1e9))  # the total norm (nothing clipped)


@pytest.mark.parametrize("name", sorted(KEYS))
def test_optimizer_state_moves_bit_exact_on_shrink_and_grow(tmp_path: Path, name: str) -> None:
    dump, lr_log = tmp_path / "dump", tmp_path / "lr.log"
    dump.mkdir()
    rows = shrink_and_grow(tmp_path, "opt", "tp2dp2,tp2dp1", "pp1tp2dp1", SCRIPT,
                           ["--steps", str(STEPS), "--optimizer", name, "--clip", "0.5", "--dump-dir", str(dump),
                            "--lr-log", str(lr_log), "--step-sleep", "0.5"])
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)), rows  # every step once
    layouts = [r[1] for r in rows]
    assert len([s for s in range(1, STEPS) if layouts[s] != layouts[s - 1]]) == 2, layouts
    assert_state_carried(dump, STEPS)  # across both migrations, bit for bit
    state = torch.load(dump / f"after-{STEPS}.pt")
    assert {k.rsplit(".", 1)[1] for k in state if k.startswith("optim.state.")} == KEYS[name]
    script = _script()
    norms = {int(s): float(n) for s, _lr, n in (line.split() for line in lr_log.read_text().splitlines())}
    for s in range(1, STEPS + 1):
        want = _unsharded_norm(script, torch.load(dump / f"before-{s}.pt"), s)
        assert norms[s] == pytest.approx(want, rel=1e-4), (s, layouts[s - 1])
