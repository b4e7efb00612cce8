"""What a layout survives (launcher.survival), on hand-worked placements, and the default safety
checkpoint interval that follows from it."""
from __future__ import annotations

import pytest

from launcher.survival import DEFAULT_CHECKPOINT_EVERY, auto_checkpoint_every, survival
from migrate.layout import ParallelConfig

TWO_BY_TWO = {0: "a", 1: "a", 2: "b", 3: "b"}


@pytest.mark.parametrize("layout, devices, process, node", [
    # ranks in (pp, dp, tp) order: pp2dp2 packed puts both replicas of stage 0 on a, of stage 1 on b
    ("pp2dp2", (0, 1, 2, 3), True, False),
    # stage 0's replicas on a and b, stage 1's on a and b
    ("pp2dp2", (0, 2, 1, 3), True, True),
    ("pp2", (0, 2), False, False),  # no replica at all
    ("pp1dp2", (0, 1), True, False),  # both replicas on node a
    ("pp1tp2dp2", (0, 1, 2, 3), True, True),  # one TP group per node: either node has a full replica
    ("pp1tp2", (0, 1), False, False),
])
def test_survival_by_hand(layout, devices, process, node) -> None:
    got = survival(ParallelConfig.parse(layout), devices, TWO_BY_TWO)
    assert (got.process, got.node) == (process, node)
    assert ("does not survive the loss of any one node" in got.describe()) == (not node)


def test_default_checkpoints_only_where_a_node_loss_would_cost_the_job() -> None:
    layouts = [ParallelConfig.parse(x) for x in ("pp2dp2", "pp2")]
    assert auto_checkpoint_every(2, 2, 2, layouts, None, "resilient") == 0
    assert auto_checkpoint_every(2, 2, 2, layouts, None, "packed") == DEFAULT_CHECKPOINT_EVERY
    # the job may shrink to one node: no layout survives losing it
    assert auto_checkpoint_every(1, 2, 2, layouts, None, "resilient") == DEFAULT_CHECKPOINT_EVERY
    assert auto_checkpoint_every(2, 2, 2, [ParallelConfig.parse("pp4")], None, "resilient") == DEFAULT_CHECKPOINT_EVERY


def test_placement_choices_are_the_planners() -> None:
    from launcher.options import PLACEMENTS
    from migrate.allocator import PLACEMENTS as PLANNER

    assert sorted(PLACEMENTS) == sorted(PLANNER) and PLACEMENTS[0] == "resilient"

