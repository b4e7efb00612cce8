"""The training state one device holds for its virtual rank, keyed by the layout rules' tensor names.

Initial values are drawn per *full* tensor from a seed and the tensor's name, then cut to the
local shard, so every layout starts from the same model: runs on different layouts, and runs
that migrate, can be compared number for number.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from migrate.layout import ModelSpec, ParallelConfig, TensorSpec
from migrate.workload import Workload, held_tensors, rank_workload

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LocalState:
    """tensors[kind][name] is this device's shard; `step` counts finished optimizer steps."""

    tensors: dict[str, dict[str, torch.Tensor]]
    step: int = 0
    meta: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for per in self.tensors.values() for t in per.values())


def shard_range(spec: TensorSpec, w: Workload) -> tuple[int, int]:
    """(offset, length) along the TP dimension of this workload's shard; the whole tensor if replicated."""
    if spec.tp_dim is None:
        return 0, spec.shape[0] if spec.shape else 1
    unit = spec.shape[spec.tp_dim] // w.of
    return w.slice_lo * unit, (w.slice_hi - w.slice_lo) * unit


def local_shape(spec: TensorSpec, w: Workload) -> tuple[int, ...]:
    if spec.tp_dim is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.tp_dim] = shard_range(spec, w)[1]
    return tuple(shape)


def init_full(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The full initial value of one tensor: a function of (seed, name) only."""
    if spec.name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
        return torch.ones(spec.shape)
    if spec.name.endswith("bias"):
        return torch.zeros(spec.shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    return torch.randn(spec.shape, generator=g) * 0.02


def initial_state(model: ModelSpec, cfg: ParallelConfig, rank: int, seed: int) -> LocalState:
    """Fresh state for one rank: params cut from the seeded full tensors, Adam moments zero."""
    w = rank_workload(cfg, rank, model.layers, cfg.tp)
    dtype = TORCH_DTYPES[model.dtype]
    tensors: dict[str, dict[str, torch.Tensor]] = {k: {} for k in model.state_kinds}
    for spec in held_tensors(model, w):
        full = init_full(spec, seed)
        if spec.tp_dim is not None:
            off, length = shard_range(spec, w)
            full = full.narrow(spec.tp_dim, off, length)
        full = full.contiguous()
        tensors["param"][spec.name] = full.to(dtype)
        if "master" in tensors:
            tensors["master"][spec.name] = full.clone()
        for kind in ("exp_avg", "exp_avg_sq"):
            if kind in tensors:
                tensors[kind][spec.name] = torch.zeros_like(full)
    return LocalState(tensors)
