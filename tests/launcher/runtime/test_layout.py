"""launcher.runtime.layout: a live-mode worker's place in a PP x DP x TP layout, checked against the
grid enumerated in Megatron's order (TP fastest, then DP, then PP) by nested loops."""
from __future__ import annotations

import itertools

import pytest
from torch import nn

from launcher.runtime.layout import keep_stage_blocks, parse_layout


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


def _meshes(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from launcher.runtime.layout import device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=8)
    out = {}
    # three layouts of the same world one after another, as a kept world gets after migrations
    for text in ("pp2tp2dp2", "pp1tp8dp1", "pp2tp2dp2", "pp4tp1dp2"):
        lay = parse_layout(text, rank, 8)
        lay.mesh = device_mesh(lay)
        got = {}
        for dim in ("pp", "dp", "tp"):
            group = lay.mesh.get_group(dim)
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            got[dim] = (sorted(dist.get_process_group_ranks(group)), float(t))
        sub = lay.mesh["dp", "tp"]  # what checkpoints place a stage's pieces on
        got["dp_tp"] = sub.mesh.flatten().tolist()
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=sub.get_group("tp"))
        got["dp_tp.tp"] = float(t)
        out[text, len(out)] = got
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, out))


def test_device_mesh_groups_are_the_grid_lines_through_each_rank() -> None:
    """Real processes (gloo): each dimension's group holds exactly the ranks that differ from this one in
    that coordinate alone (nested loops over the Megatron grid), sums over it agree, and slicing (dp, tp)
    works, for several layouts formed one after another in one world."""
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_meshes, 8)
    for (text, _i), _ in got[0].items():
        lay = parse_layout(text, 0, 8)
        grid = {}
        for p, d, t in itertools.product(range(lay.pp), range(lay.dp), range(lay.tp)):
            grid[p, d, t] = len(grid)
        coords = {r: c for c, r in grid.items()}
        for rank in range(8):
            p, d, t = coords[rank]
            line = {"pp": [grid[q, d, t] for q in range(lay.pp)], "dp": [grid[p, q, t] for q in range(lay.dp)],
                    "tp": [grid[p, d, q] for q in range(lay.tp)]}
            mine = got[rank][text, _i]
            for dim, ranks in line.items():
                assert mine[dim] == (sorted(ranks), float(sum(ranks))), (text, rank, dim)
            assert mine["dp_tp"] == [grid[p, a, b] for a in range(lay.dp) for b in range(lay.tp)]
            assert mine["dp_tp.tp"] == float(sum(line["tp"]))
