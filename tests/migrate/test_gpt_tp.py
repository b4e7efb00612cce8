"""The reference GPT's TP all-reduce (migrate.gpt.tp_all_reduce) on gloo, in real processes.

Oracle: the float64 sum of every member's tensor (independent of any summation order), and the rule
replicated parameters need: every member gets the bit-identical float32 result. Inputs span several
orders of magnitude (x2 per rank, which float32 still sums to ~1e-4) so that a member adding in another
order, or any one missing part, shows. Group sizes 4 and 8 take recursive doubling (2 and 3 rounds),
3 the one-round exchange."""
from __future__ import annotations

import functools

import pytest

from tests.migrate.spawned import run_spawned

# world ranks in TP order, not sorted: group ranks and TP slots differ
TP_ORDERS = {3: [2, 0, 1], 4: [2, 0, 3, 1], 8: [5, 2, 7, 0, 3, 6, 1, 4]}


def _member_input(rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    return torch.randn(4096, generator=g) * 2.0 ** rank


def _reduce(order: list[int], rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from migrate.gpt import TPGroup

    n = len(order)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    tp = TPGroup(dist.new_group(list(range(n))), order, order.index(rank))
    x = _member_input(rank)
    forward = tp.reduce(x.clone())  # reduce-from-TP: the sum in forward
    leaf = x.clone().requires_grad_()
    tp.copy(leaf).backward(x.clone())  # copy-to-TP: the sum of the gradients in backward
    queue.put((rank, {"forward": forward, "backward": leaf.grad, "input_kept": torch.equal(x, _member_input(rank)),
                      "direct": tp.direct_members}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("n", sorted(TP_ORDERS))
def test_every_member_gets_the_same_sum_of_all_parts(n: int) -> None:
    import torch

    order = TP_ORDERS[n]
    got = run_spawned(functools.partial(_reduce, order), n)
    exact = sum(_member_input(r).double() for r in range(n))
    first = got[0]["forward"]
    assert float((first.double() - exact).abs().max()) < 1e-3  # float32 rounding
    for r in range(n):  # while any one part left out would be far off
        assert float((first.double() - exact + _member_input(r).double()).abs().max()) > 0.5
    for rank in range(n):
        assert got[rank]["direct"] == order  # gloo: exchanged between members, who are named by group rank
        assert torch.equal(got[rank]["forward"], first), rank
        assert torch.equal(got[rank]["backward"], first), rank
        assert got[rank]["input_kept"]
