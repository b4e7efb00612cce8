"""The reference GPT's TP all-reduce (migrate.gpt.tp_all_reduce) on gloo, in real processes.

Oracle: the float64 sum of every member's tensor (independent of any summation order), and the rule
replicated parameters need: every member gets the bit-identical float32 result. Inputs span several
orders of magnitude so that a member adding in another order, or a missing part, shows."""
from __future__ import annotations

from tests.migrate.spawned import run_spawned

TP_ORDER = [2, 0, 3, 1]  # world ranks in TP order, not sorted: group ranks and TP slots differ


def _member_input(rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    return torch.randn(4096, generator=g) * 10.0 ** rank


def _reduce(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from migrate.gpt import TPGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    tp = TPGroup(dist.new_group([0, 1, 2, 3]), TP_ORDER, TP_ORDER.index(rank))
    x = _member_input(rank)
    forward = tp.reduce(x.clone())  # reduce-from-TP: the sum in forward
    leaf = x.clone().requires_grad_()
    tp.copy(leaf).backward(x.clone())  # copy-to-TP: the sum of the gradients in backward
    queue.put((rank, {"forward": forward, "backward": leaf.grad, "input_kept": torch.equal(x, _member_input(rank)),
                      "direct": tp.direct_members}))
    dist.barrier()
    dist.destroy_process_group()


def test_every_member_gets_the_same_sum_of_all_parts() -> None:
    import torch

    got = run_spawned(_reduce, 4)
    exact = sum(_member_input(r).double() for r in range(4))
    first = got[0]["forward"]
    assert float((first.double() - exact).abs().max()) < 1e-3  # float32 rounding; a missing part is ~1
    for rank in range(4):
        assert got[rank]["direct"] == [2, 0, 3, 1]  # gloo: the one-round exchange, members as group ranks
        assert torch.equal(got[rank]["forward"], first), rank
        assert torch.equal(got[rank]["backward"], first), rank
        assert got[rank]["input_kept"]
