"""Checkpoints for suspend/resume and periodic safety: torch.distributed.checkpoint, any layout in, any out.

Every tensor is saved as a DTensor on the rank's (dp, tp) slice of the layout: TP-sharded
tensors carry their offset in the full tensor and DP replicas are `Replicate`, so DCP writes each
piece of state exactly once and a load on another layout reads only the slices it needs.
Step, RNG state and data position travel in the same checkpoint, so a resumed run continues at
the exact next step.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh

from migrate.layout import ModelSpec, ParallelConfig
from migrate.state import TORCH_DTYPES, LocalState, local_shape
from migrate.workload import held_tensors, rank_workload


def layout_mesh(cfg: ParallelConfig, world_rank: list[int]) -> DeviceMesh:
    """This rank's (dp, tp) mesh, in the layout's world ranks (they need not be 0..n-1 in order)."""
    grid = torch.tensor(world_rank, dtype=torch.int64).view(cfg.pp, cfg.dp, cfg.tp)
    me = dist.get_rank()
    pp = int((grid == me).nonzero()[0][0])
    return DeviceMesh("cpu", grid[pp], mesh_dim_names=("dp", "tp"), _init_backend=False)


def as_dtensors(model: ModelSpec, tensors: dict[str, dict[str, torch.Tensor]], mesh: DeviceMesh) -> dict[str, Any]:
    """Flat DCP state dict `kind/name -> DTensor` over this rank's own tensors (no copies)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    specs = {t.name: t for t in model.tensors()}
    out: dict[str, Any] = {}
    for kind, per in tensors.items():
        for name, t in per.items():
            spec = specs[name]
            placements = (Replicate(), Replicate() if spec.tp_dim is None else Shard(spec.tp_dim))
            out[f"{kind}/{name}"] = DTensor.from_local(t, mesh, placements, run_check=False,
                                                       shape=torch.Size(spec.shape),
                                                       stride=torch.empty(spec.shape, device="meta").stride())
    return out


def _state_dict(model: ModelSpec, cfg: ParallelConfig, state: LocalState, world_rank: list[int]) -> dict[str, Any]:
    sd = as_dtensors(model, state.tensors, layout_mesh(cfg, world_rank))
    sd["run/step"] = state.step
    sd["run/meta"] = pickle.dumps({k: v for k, v in state.meta.items()})
    sd["run/layout"] = str(cfg)
    return sd


def save_checkpoint(model: ModelSpec, cfg: ParallelConfig, state: LocalState, path: str | Path,
                    world_rank: list[int] | None = None, group=None) -> None:
    """Write this rank's part of the job's state; every rank of the layout calls it. (Live jobs, the
    reference worker's included, checkpoint through launcher.runtime.ckpt, in the background there.)"""
    world_rank = world_rank or list(range(cfg.world_size))
    Path(path).mkdir(parents=True, exist_ok=True)
    dcp.save(_state_dict(model, cfg, state, world_rank), checkpoint_id=str(path), process_group=group)


def load_checkpoint(model: ModelSpec, cfg: ParallelConfig, rank: int, path: str | Path,
                    world_rank: list[int] | None = None, group=None) -> LocalState:
    """This rank's state of layout `cfg`, read from a checkpoint written by any layout."""
    if not (Path(path) / ".metadata").exists():
        raise FileNotFoundError(f"no checkpoint at {path} (expected {path}/.metadata)")
    world_rank = world_rank or list(range(cfg.world_size))
    w = rank_workload(cfg, rank, model.layers, cfg.tp)
    tensors: dict[str, dict[str, torch.Tensor]] = {k: {} for k in model.state_kinds}
    for spec in held_tensors(model, w):
        for kind in model.state_kinds:
            dtype = TORCH_DTYPES[model.dtype] if kind == "param" else torch.float32
            tensors[kind][spec.name] = torch.empty(local_shape(spec, w), dtype=dtype)
    sd = as_dtensors(model, tensors, layout_mesh(cfg, world_rank))
    sd.update({"run/step": -1, "run/meta": b"", "run/layout": ""})
    dcp.load(sd, checkpoint_id=str(path), process_group=group)
    return LocalState(tensors, int(sd["run/step"]), pickle.loads(sd["run/meta"]) if sd["run/meta"] else {})


def checkpoint_step(path: str | Path) -> int | None:
    """The step a checkpoint was taken at, without loading it (None if there is none)."""
    meta = Path(path) / ".metadata"
    if not meta.exists():
        return None
    import warnings

    sd: dict[str, Any] = {"run/step": -1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return int(sd["run/step"])
