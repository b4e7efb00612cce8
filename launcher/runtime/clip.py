"""Gradients of a model cut by a layout: averaged over the DP replicas (Job.reduce_gradients), and clipped
by the global norm (Job.clip_grad_norm_).

Why not torch.nn.utils.clip_grad_norm_: on the parameters a `tp_plan` leaves (DTensors beside the plain
tensors of the modules outside the plan) it fails with "mixed torch.Tensor and DTensor", and on one rank
it could not see the other pipeline stages' gradients anyway. The norm here is the one the whole unsharded
model has: each rank adds up |g|^p over its local tensors; the pieces of a TP-sharded tensor (a DTensor
with a Shard placement, or a plain tensor the rank's manifest says is a TP shard, for a model that shards
itself) are summed over the TP group, a replicated tensor counts once (every TP rank holds the same); the
stages' sums are added over the pipeline group; DP replicas hold the same gradients after
reduce_gradients, so nothing is summed over DP. Under FSDP every rank holds a different shard of every
gradient (FSDP2 reduce-scatters them in backward): the sums are added over the FSDP group too. For norm_type inf the maximum replaces the sums.
Then every gradient is scaled by min(1, max_norm / (total + 1e-6)), torch's rule.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from launcher.runtime.state import to_local


def average_over_dp(params: Iterable, layout) -> None:
    """Average the gradients of `params` over `layout`'s DP replicas (all-reduce, then divide); under FSDP
    (HSDP too) FSDP2 did it in backward."""
    import torch.distributed as dist

    if layout.dp == 1 or layout.fsdp > 1:
        return
    for p in params:
        if p.grad is not None:
            g = to_local(p.grad)
            dist.all_reduce(g, group=layout.dp_group)
            g.div_(layout.dp)


def clip_grad_norm_(named_params: Iterable, layout, max_norm: float, norm_type: float = 2.0, manifest=None):
    """Clip the gradients of `named_params` ((name, parameter) of this rank's stage on `layout`, a
    launcher.runtime.layout.Layout with its mesh) to the global norm `max_norm`; returns that total norm
    (a 0-dim tensor, the same on every rank). `manifest` (this rank's migrate.manifest.Manifest) tells which
    plain tensors are TP shards."""
    import torch

    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type} (a positive number or inf)")
    pieces = manifest.by_fqn() if manifest is not None else {}
    grads = [(g, _sharded(name, g, pieces)) for name, prm in named_params if (g := prm.grad) is not None]
    locals_ = [(_local(g), sharded) for g, sharded in grads]
    total = _global_norm(locals_, p, layout)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g, _sharded_ in locals_:
            g.mul_(coef.to(g.dtype))
    return total


def _global_norm(locals_: list, p: float, layout):
    """The norm over every stage and TP rank of this rank's local gradients (see the module docstring)."""
    import torch
    import torch.distributed as dist

    inf = math.isinf(p)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM

    def part(sharded: bool):
        terms = [torch.linalg.vector_norm(g.float(), p) for g, s in locals_ if s == sharded]
        if not terms:
            return torch.zeros((), dtype=torch.float32)
        norms = torch.stack(terms)
        return norms.max() if inf else norms.pow(p).sum()

    sharded, whole = part(True), part(False)
    if layout.tp > 1:
        dist.all_reduce(sharded, op=op, group=layout.mesh.get_group("tp"))
    total = torch.maximum(sharded, whole) if inf else sharded + whole
    if layout.fsdp > 1:
        dist.all_reduce(total, op=op, group=layout.mesh.get_group("fsdp"))
    if layout.pp > 1:
        dist.all_reduce(total, op=op, group=layout.pp_group)
    return total if inf else total.pow(1.0 / p)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _sharded(name: str, grad, pieces) -> bool:
    """Whether this rank holds a TP piece of `name`'s gradient (rather than the whole of it, or only its
    FSDP shard: summed over the FSDP group with everything else)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's over a TP shard's dim 0

    if isinstance(grad, DTensor):
        names = grad.device_mesh.mesh_dim_names or ()
        for placement in grad.placements:
            if not (isinstance(placement, (Shard, _StridedShard)) or placement.is_replicate()):
                raise ValueError(f"clip_grad_norm_: {name}'s gradient has placement {placement} (Shard or "
                                 "Replicate expected: call it after backward, before optimizer.step)")
        return any(isinstance(pl, Shard) and (not names or names[i] == "tp") for i, pl in enumerate(grad.placements))
    entry = pieces.get(name)
    return entry is not None and entry.dim is not None and entry.count > 1
