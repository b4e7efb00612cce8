"""What a layout survives (launcher.policy.survival), on hand-worked placements, and the default safety
checkpoint interval that follows from it."""
from __future__ import annotations

import itertools
import math

import pytest

from launcher.policy.survival import DEFAULT_CHECKPOINT_EVERY, Survival, auto_checkpoint_every, survival
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
    assert got.describe() == SAID[(process, node)]


SAID = {(True, True): "survives the loss of any one process and any one node",
        (True, False): "survives the loss of any one process; not of any one node",
        (False, False): "does not survive the loss of any one process or any one node"}


def test_what_a_layout_survives_is_said_in_one_clause_with_the_batch_node_and_the_allocations_terms() -> None:
    assert Survival(True, True, batch=True).describe() == \
        "survives the loss of any one process, any one node and the batch node"
    assert Survival(True, False, node_note="a Slurm step ends", batch=False).describe() == \
        "survives the loss of any one process; not of any one node (a Slurm step ends) or the batch node"
    assert Survival(False, False, batch=False).describe() == \
        "does not survive the loss of any one process, any one node or the batch node"


def test_default_checkpoints_only_where_a_node_loss_would_cost_the_job() -> None:
    layouts = [ParallelConfig.parse(x) for x in ("pp2dp2", "pp2")]
    assert auto_checkpoint_every(2, 2, 2, layouts, None, "resilient") == 0
    assert auto_checkpoint_every(2, 2, 2, layouts, None, "packed") == DEFAULT_CHECKPOINT_EVERY
    # the job may shrink to one node: no layout survives losing it
    assert auto_checkpoint_every(1, 2, 2, layouts, None, "resilient") == DEFAULT_CHECKPOINT_EVERY
    assert auto_checkpoint_every(2, 2, 2, [ParallelConfig.parse("pp4")], None, "resilient") == DEFAULT_CHECKPOINT_EVERY


def test_a_huge_node_range_gets_the_safe_answer_at_once() -> None:
    # `--nnodes 1:9999999` (the command-line fuzz found it): enumerating node choices recursed as deep as the
    # node count (RecursionError); past MAX_NODES_CHECKED the answer is a checkpoint, without enumerating
    layouts = [ParallelConfig.parse("pp1dp2")]
    assert auto_checkpoint_every(2, 9_999_999, 1, layouts, None, "resilient") == DEFAULT_CHECKPOINT_EVERY
    assert auto_checkpoint_every(2, 4, 1, layouts, None, "resilient") == 0  # few nodes: the real answer


def test_placement_choices_are_the_planners() -> None:
    from launcher.options import PLACEMENTS
    from migrate.allocator import PLACEMENTS as PLANNER

    assert sorted(PLACEMENTS) == sorted(PLANNER) and PLACEMENTS[0] == "resilient"



# ---------------------------------------------------------------------------------------------------
# Uneven nodes (issue 13): the real node sizes, checked against a brute force that shares no code
# with launcher.policy.survival or the policy: every choice of n nodes, every placement of the TP groups.

def _oracle_layout(devices: int, fit: int, layouts: list[ParallelConfig]) -> ParallelConfig | None:
    """The listed layout using the most devices (ties: the earlier), TP dividing every node's size."""
    ok = [c for c in layouts if c.pp * c.tp * c.dp <= devices and fit % c.tp == 0]
    return max(ok, key=lambda c: (c.pp * c.tp * c.dp, -layouts.index(c)), default=None)


def _oracle_survives(pp: int, tp: int, dp: int, sizes: tuple[int, ...], placement: str) -> bool:
    if placement == "packed":  # rank (p * dp + d) * tp + t on the device of that number, node by node
        node_of = [i for i, s in enumerate(sizes) for _ in range(s)]
        return all(len({node_of[(p * dp + d) * tp + t] for d in range(dp)}) >= 2 for p in range(pp) for t in range(tp))
    # resilient: does ANY placement of the pp * dp TP groups (inside nodes) leave every stage on >= 2 nodes?
    for where in itertools.product(range(len(sizes)), repeat=pp * dp):  # group (p, d) -> node
        seats = [0] * len(sizes)
        for n in where:
            seats[n] += tp
        if all(seats[n] <= sizes[n] for n in range(len(sizes))) and all(
                len({where[p * dp + d] for d in range(dp)}) >= 2 for p in range(pp)):
            return True
    return False


def _oracle_checkpoint_every(lo: int, hi: int, sizes: tuple[int, ...], layouts: list[ParallelConfig],
                             placement: str) -> int:
    fit = math.gcd(*sizes)
    for n in range(lo, hi + 1):
        for pick in itertools.combinations(range(len(sizes)), n):
            held = tuple(sizes[i] for i in pick)
            c = _oracle_layout(sum(held), fit, layouts)
            if c is not None and not _oracle_survives(c.pp, c.tp, c.dp, held, placement):
                return DEFAULT_CHECKPOINT_EVERY
    return 0


UNEVEN_CASES = [
    # (node sizes in allocation order, node range, layouts)
    ((4, 4, 2, 2), (2, 4), "pp2tp2dp3,pp2tp2dp2,pp1tp2dp2,pp1tp2dp1"),
    ((4, 4, 2, 2), (2, 4), "pp2dp6,pp2dp5,pp2dp4,pp2dp3,pp2dp2"),
    ((4, 4, 2, 2), (3, 4), "pp2dp6,pp2dp5,pp2dp4"),
    ((3, 1), (2, 2), "pp2dp2"),  # the 3-GPU node holds 3 of 4 groups: some stage is all on it
    ((4, 2), (2, 2), "pp2dp3,pp2dp2"),
    ((2, 4), (2, 2), "pp3dp2"),
    ((6, 2, 2), (2, 3), "pp1tp2dp5,pp1tp2dp4,pp1tp2dp3,pp1tp2dp2"),
    ((6, 2, 2), (2, 3), "pp2tp2dp2,pp1tp2dp3,pp1tp2dp2"),
    ((8, 4, 4, 2), (1, 4), "pp3dp6,pp2dp7,pp4dp4,pp3dp4,pp2dp4,pp2dp3,pp1dp2,pp1dp1"),
]


@pytest.mark.parametrize("placement", ["resilient", "packed"])
@pytest.mark.parametrize("sizes, nodes, layouts", UNEVEN_CASES)
def test_checkpoint_default_on_uneven_nodes_uses_the_real_node_sizes(sizes, nodes, layouts, placement) -> None:
    cfgs = [ParallelConfig.parse(x) for x in layouts.split(",")]
    want = _oracle_checkpoint_every(*nodes, sizes, cfgs, placement)
    assert auto_checkpoint_every(*nodes, sizes, cfgs, None, placement) == want


def test_uneven_cases_are_not_all_one_answer() -> None:
    """The cases above tell the largest-node estimate from the real sizes: (3, 1) with pp2dp2 needs
    checkpoints (the old estimate, two 3-GPU nodes, said it survives), and both answers occur."""
    pp2dp2 = [ParallelConfig.parse("pp2dp2")]
    assert auto_checkpoint_every(2, 2, (3, 1), pp2dp2, None, "resilient") == DEFAULT_CHECKPOINT_EVERY
    assert auto_checkpoint_every(2, 2, 3, pp2dp2, None, "resilient") == 0  # two 3-GPU nodes would survive
    answers = {_oracle_checkpoint_every(*n, s, [ParallelConfig.parse(x) for x in ls.split(",")], p)
               for s, n, ls in UNEVEN_CASES for p in ("resilient", "packed")}
    assert answers == {0, DEFAULT_CHECKPOINT_EVERY}
