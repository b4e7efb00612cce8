"""examples/titan_live.py (a torchtitan-shaped script: Llama-style blocks with torchtitan's TP plan, FSDP2, AdamW
with weight-decay groups, warm-up + cosine LambdaLR, gradient clipping) under `elastic-launch --backend
local`, shrunk from FSDP2 x TP (tp2fsdp2: every parameter and AdamW moment a quarter per rank) to tp2dp1 and
grown back live. Oracles: the same script run without a resize,
and the schedule stepped alone in this process. Every step runs once; its lr is the schedule's bit for bit;
its loss is the uninterrupted run's bit for bit up to the first migration and after it within float noise
(on dp1 the gradient is summed in another order), and so is the clipped gradient norm."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.examples.harness import assert_state_carried, mixer_rows, run_local, shrink_and_grow
from tests.paths import ROOT

STEPS = 24


def _lr_rows(path: Path) -> dict[int, tuple[float, float]]:
    return {int(s): (float(lr), float(norm)) for s, lr, norm in (line.split() for line in path.read_text().splitlines())}


def _example():
    spec = importlib.util.spec_from_file_location("titan_live", ROOT / "examples" / "titan_live.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_torchtitan_shaped_script_shrinks_and_grows_on_its_schedule(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    run_local(ref, ["--gpus-per-node", "2", "--layouts", "tp2fsdp2,tp2dp1", "--job-name", "ref"],
              ["titan_live.py", "--steps", str(STEPS), "--log", str(ref / "steps.log"), "--lr-log", str(ref / "lr.log")],
              lambda alive: None)
    want, want_lr = mixer_rows(ref / "steps.log"), _lr_rows(ref / "lr.log")
    assert [r[0] for r in want] == list(range(1, STEPS + 1)) and {r[1] for r in want} == {"pp1tp2dp1fsdp2"}
    dump = tmp_path / "dump"
    dump.mkdir()
    rows = shrink_and_grow(tmp_path, "titan", "tp2fsdp2,tp2dp1", "pp1tp2dp1", "titan_live.py",
                           ["--steps", str(STEPS), "--lr-log", str(tmp_path / "lr.log"), "--step-sleep", "0.5",
                            "--dump-dir", str(dump)])
    assert_state_carried(dump, STEPS)  # every parameter and AdamW moment, whole (full_tensor), across both moves
    got_lr = _lr_rows(tmp_path / "lr.log")
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)), rows  # every step once
    assert [r[2] for r in rows] == [8 * s for s in range(1, STEPS + 1)]  # the data position travelled
    layouts = [r[1] for r in rows]
    moved = [s for s in range(1, STEPS) if layouts[s] != layouts[s - 1]]
    assert len(moved) == 2 and layouts[moved[0]] == "pp1tp2dp1", layouts

    titan = _example()  # the schedule alone: warm-up then cosine, from the example's own factor
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=titan.LR)
    sched, schedule = titan.warmup_cosine(STEPS)(opt), []
    for _ in range(STEPS):
        schedule.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [got_lr[s][0] for s in range(1, STEPS + 1)] == schedule == [want_lr[s][0] for s in range(1, STEPS + 1)]
    assert schedule[0] < schedule[4] == titan.LR > schedule[-1]  # it warms up, then decays

    first = moved[0]  # rows[first] is the first step on the shrunk layout
    assert [r[3] for r in rows[:first]] == [r[3] for r in want[:first]]  # bit-equal before any migration
    assert [r[3] for r in rows] == pytest.approx([r[3] for r in want], rel=1e-4)
    assert [got_lr[s][1] for s in range(1, STEPS + 1)] == pytest.approx([want_lr[s][1] for s in range(1, STEPS + 1)],
                                                                         rel=1e-3)
    assert rows[-1][3] < 0.5 * rows[0][3]  # and it learns

    from db import Store

    store = Store(f"sqlite:///{tmp_path}/e.db")
    maps = store.rank_maps(store.find_job("titan").id)
    assert [m.layout for m in maps] == ["pp1tp2dp1fsdp2", "pp1tp2dp1", "pp1tp2dp1fsdp2"]
    # an FSDP rank's data-parallel rank is recorded: every rank its own (pp, dp, tp), a TP group one (pp, dp)
    assert sorted((e.pp, e.dp, e.tp) for e in maps[0].entries) == [(0, d, t) for d in range(2) for t in range(2)]
