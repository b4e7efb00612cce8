"""Job.clip_grad_norm_ (launcher.runtime.clip) on a model cut by a layout, in real gloo processes: the model
is built as the runtime builds it (launcher.runtime.build.Builder: pipeline stages, parallelize_module's
DTensors beside plain LayerNorm parameters, where torch's own clip_grad_norm_ fails with "mixed
torch.Tensor and DTensor"). Every rank is given its piece of the same whole gradients; the oracle is
torch.nn.utils.clip_grad_norm_ on one unsharded model holding those gradients: the total norm and every
clipped gradient agree (within float32 summation order), for the 2-norm, the 1-norm and the inf norm, with
and without clipping, on tp2, pp2 and dp2 (replicas are not summed), and with FSDP2 (fully_shard by the Builder,
each block a unit of its own as join's fsdp_units asks: every gradient reduce-scattered, a shard per rank)
alone, over TP, and as HSDP."""
from __future__ import annotations

import functools
import math
import os

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from migrate.layout import ParallelConfig
from tests.migrate.spawned import run_spawned

CASES = [(norm, max_norm) for norm in (2.0, 1.0, math.inf) for max_norm in (0.5, 1e4)]
TP_PLAN = {"blocks.*.0": ColwiseParallel(), "blocks.*.2": RowwiseParallel()}


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6), nn.LayerNorm(6))
                                    for _ in range(4))


def _stage(layout) -> Stack:
    from launcher.runtime.layout import keep_stage_blocks

    m = Stack()
    keep_stage_blocks(m.blocks, layout)
    return m


def _grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(p.shape, generator=g) for n, p in Stack().named_parameters()}


def _worker(layout: str, world: int, rank: int, port: int, q) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    from launcher.runtime.build import Builder
    from launcher.runtime.clip import clip_grad_norm_
    from launcher.runtime.layout import device_mesh, parse_layout

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    lay = parse_layout(layout, rank, world)
    dist.init_process_group("gloo", rank=rank, world_size=lay.world_size)
    lay.mesh = device_mesh(lay)
    builder = Builder(_stage, TP_PLAN, lambda params: torch.optim.SGD(params, lr=0.1),
                      fsdp_units=lambda module: module.blocks)
    model, _opt = builder.build(lay)
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(b, FSDPModule) for b in model.blocks)
    whole, out = _grads(), []
    torch_says = ""
    for n, p in model.named_parameters():
        p.grad = torch.zeros_like(p)
    try:  # what this replaces: torch's own on the same parameters
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    except RuntimeError as exc:
        torch_says = str(exc)
    for norm, max_norm in CASES:
        for n, p in model.named_parameters():
            p.grad = distribute_tensor(whole[n].clone(), p.device_mesh, p.placements) if isinstance(p, DTensor) \
                else whole[n].clone()
        total = clip_grad_norm_(model.named_parameters(), lay, max_norm, norm,
                                builder.manifests(lay.name)[lay.rank])
        clipped = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).numpy().copy() for n, p in
                   model.named_parameters()}  # numpy: pickled by value (a tensor would go by shared memory)
        out.append((float(total), clipped))
    q.put((rank, (out, torch_says, units)))
    dist.barrier()
    dist.destroy_process_group()


def _oracle() -> list[tuple[float, dict[str, torch.Tensor]]]:
    model, whole, out = Stack(), _grads(), []
    for norm, max_norm in CASES:
        for n, p in model.named_parameters():
            p.grad = whole[n].clone()
        total = nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm)
        out.append((float(total), {n: p.grad for n, p in model.named_parameters()}))
    return out


@pytest.mark.parametrize("layout, world", [("tp2", 2), ("pp2", 2), ("dp2", 2), ("fsdp2", 2), ("tp2fsdp2", 4),
                                           ("hsdp2x2", 4)])
def test_the_total_norm_and_the_clipped_gradients_are_the_unsharded_models(layout: str, world: int) -> None:
    got = run_spawned(functools.partial(_worker, layout, world), world)
    want = _oracle()
    for rank in range(world):
        got[rank], torch_says, units = got[rank]
        assert units == (4 if ParallelConfig.parse(layout).fsdp > 1 else 0)  # each block its own FSDP unit
        if "fsdp" not in layout:
            assert ("mixed torch.Tensor and DTensor" in torch_says) == ("tp2" in layout), torch_says
        for (norm, max_norm), (total, grads), (want_total, want_grads) in zip(CASES, got[rank], want):
            assert total == pytest.approx(want_total, rel=1e-5), (layout, rank, norm, max_norm)
            for n, g in grads.items():  # this rank's stage's parameters, whole
                torch.testing.assert_close(torch.from_numpy(g), want_grads[n], rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"{layout} rank {rank} {n} {norm} {max_norm}: {m}")
        assert len(grads) == (len(want_grads) if "pp2" not in layout else len(want_grads) // 2)
