"""Reassemble full tensors from per-device shards, to compare layouts with torch.equal."""
from __future__ import annotations

import torch

from migrate.layout import ModelSpec, ParallelConfig
from migrate.state import LocalState, shard_range
from migrate.workload import held_tensors, rank_workload


def assemble(model: ModelSpec, cfg: ParallelConfig, devices: list[int], states: dict[int, LocalState]
             ) -> dict[tuple[str, str], torch.Tensor]:
    """(kind, name) -> full tensor. Every DP replica must agree, or this fails; missing devices are skipped."""
    specs = {t.name: t for t in model.tensors()}
    full: dict[tuple[str, str], torch.Tensor] = {}
    for rank, dev in enumerate(devices):
        if dev not in states:
            continue
        w = rank_workload(cfg, rank, model.layers, cfg.tp)
        st = states[dev]
        for spec in held_tensors(model, w):
            for kind, per in st.tensors.items():
                key = (kind, spec.name)
                out = full.setdefault(key, torch.full(specs[spec.name].shape, float("nan")))
                if spec.tp_dim is None:
                    region = out
                else:
                    off, length = shard_range(spec, w)
                    region = out.narrow(spec.tp_dim, off, length)
                if not torch.isnan(region).all():
                    assert torch.equal(region, per[spec.name]), f"replicas disagree on {key}"
                region.copy_(per[spec.name])
    for key, t in full.items():
        assert not torch.isnan(t).any(), f"{key} not fully covered"
    return full
