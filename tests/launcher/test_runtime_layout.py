"""launcher.runtime_layout: a live-mode worker's place in a PP x DP x TP layout, checked against the
grid enumerated in Megatron's order (TP fastest, then DP, then PP) by nested loops."""
from __future__ import annotations

import itertools

import pytest
from torch import nn

from launcher.runtime_layout import keep_stage_blocks, parse_layout


@pytest.mark.parametrize("text", ["pp1tp1dp1", "pp2tp1dp2", "pp4tp2dp1", "pp3tp2dp2"])
def test_ranks_stages_and_neighbours_follow_the_megatron_grid(text: str) -> None:
    lay0 = parse_layout(text, 0, 0)
    grid = list(itertools.product(range(lay0.pp), range(lay0.dp), range(lay0.tp)))  # rank order
    for rank, (pp, dp, tp) in enumerate(grid):
        lay = parse_layout(text, rank, len(grid))
        assert (lay.pp_rank, lay.dp_rank, lay.tp_rank) == (pp, dp, tp)
        assert lay.is_first_stage == (pp == 0) and lay.is_last_stage == (pp == lay.pp - 1)
        prev = grid.index((pp - 1, dp, tp)) if pp > 0 else None
        nxt = grid.index((pp + 1, dp, tp)) if pp < lay.pp - 1 else None
        assert (lay.prev_rank, lay.next_rank) == (prev, nxt)
        assert lay.name == f"pp{lay.pp}tp{lay.tp}dp{lay.dp}"


@pytest.mark.parametrize("n,pp", [(4, 2), (24, 4), (5, 2), (7, 3), (3, 3)])
def test_stage_blocks_cover_the_blocks_once_in_order_evenly(n: int, pp: int) -> None:
    spans = [parse_layout(f"pp{pp}", r, pp).stage_blocks(n) for r in range(pp)]
    assert [i for s in spans for i in s] == list(range(n))
    assert max(map(len, spans)) - min(map(len, spans)) <= 1
    if n % pp == 0:  # the reference GPT's rule
        assert all(len(s) == n // pp for s in spans)


def test_keep_stage_blocks_keeps_global_names() -> None:
    blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    keep_stage_blocks(blocks, parse_layout("pp2", 1, 2))
    assert [k for k, _ in blocks.named_parameters()] == ["2.weight", "2.bias", "3.weight", "3.bias"]
    assert isinstance(blocks[0], nn.Identity) and isinstance(blocks[1], nn.Identity)
