"""A learning-rate schedule across migrations (tests/examples/schedule_script.py under `elastic-launch
--backend local`, live mode): the job is shrunk from tp2dp2 to tp2dp1 and grown back while its LR follows
a SequentialLR declared to `runtime.join(scheduler=...)`. Oracle: the same script run without a resize.
The lr of every step is the uninterrupted run's bit for bit (the schedule's arithmetic is the same on every
layout); so is the loss up to the first migration, and after it within float noise (a dp1 layout sums the
gradient in another order). Before the runtime carried the optimizer's settings the lr after the first
migration was the optimizer factory's (1e-2) instead of the schedule's."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples.harness import mixer_rows, run_local, shrink_and_grow

SCRIPT = "../tests/examples/schedule_script.py"  # run_local runs examples/<script>
STEPS = 60


def _lrs(path: Path) -> dict[int, float]:
    return {int(s): float(lr) for s, lr in (line.split() for line in path.read_text().splitlines())}


def test_the_lr_schedule_and_the_loss_curve_survive_a_shrink_and_a_grow(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    run_local(ref, ["--gpus-per-node", "2", "--layouts", "tp2dp2,tp2dp1", "--job-name", "ref"],
              [SCRIPT, "--steps", str(STEPS), "--log", str(ref / "steps.log"), "--lr-log", str(ref / "lr.log")],
              lambda alive: None)
    want_rows, want_lr = mixer_rows(ref / "steps.log"), _lrs(ref / "lr.log")
    assert [r[0] for r in want_rows] == list(range(1, STEPS + 1)) and {r[1] for r in want_rows} == {"pp1tp2dp2"}
    rows = shrink_and_grow(tmp_path, "sched", "tp2dp2,tp2dp1", "pp1tp2dp1", SCRIPT,
                           ["--steps", str(STEPS), "--lr-log", str(tmp_path / "lr.log"), "--step-sleep", "0.5"])
    got_lr = _lrs(tmp_path / "lr.log")
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)), rows  # every step once
    layouts = [r[1] for r in rows]
    moved = [s for s in range(1, STEPS) if layouts[s] != layouts[s - 1]]
    assert len(moved) == 2, layouts
    assert got_lr == want_lr, (layouts, got_lr, want_lr)  # the schedule's lr at every step, across both migrations
    first = moved[0]  # rows[first] is the first step on the shrunk layout
    assert [r[3] for r in rows[:first]] == [r[3] for r in want_rows[:first]]  # bit-equal before any migration
    assert [r[3] for r in rows] == pytest.approx([r[3] for r in want_rows], rel=1e-4)
