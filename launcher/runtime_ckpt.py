"""Checkpoints of a live-mode job (launcher.runtime): the state a live migration moves, written with DCP.

What is written is this rank's manifest (migrate.manifest), piece by piece: every tensor of the
model's `state_dict` and the optimizer's per-parameter state (`optim.state.<fqn>.<key>`), as a
DTensor on the layout's (dp, tp) mesh -- Replicate over DP, Shard(dim) over TP where the manifest
cuts it -- so DCP writes each piece once and a load on another layout reads only the slices it
needs (a job suspended on tp2dp2 resumes on tp2dp1). This holds the same for DTensor models
(parallelize_module) and for models that shard themselves (the reference GPT's plain local shards),
because both are described by their manifest. Beside them: every registered object's
`state_dict()` and the number of finished steps. Folders follow launcher.control's convention:
DIR/.tmp-step-<S> while it is written, renamed to DIR/step-<S> by rank 0 once every rank's part is
on disk (a safety checkpoint, or the one a suspend leaves).
"""
from __future__ import annotations

import pickle
from collections.abc import Mapping

from launcher import control as C


def _pieces(local: Mapping[str, object], manifest, mesh) -> dict:
    """FQN -> DTensor over `mesh` (dims dp, tp) wrapping this rank's local tensor (no copy)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {}
    for e in manifest.entries:
        shape = torch.Size(e.shape)
        placements = (Replicate(), Replicate() if e.dim is None else Shard(e.dim))
        out[e.fqn] = DTensor.from_local(local[e.fqn], mesh, placements, run_check=False, shape=shape,
                                        stride=torch.empty(shape, device="meta").stride())
    return out


def save(root: str, local: Mapping[str, object], manifest, mesh, extras: Mapping[str, object], step: int,
         rank: int) -> str:
    """Every rank of the training world calls it at the same step boundary with its local tensors by FQN
    (launcher.runtime's export) and its manifest; returns the final folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tmp, final = C.checkpoint_paths(root, step)
    state = {"state": _pieces(local, manifest, mesh),
             "run": {"step": step, "extras": pickle.dumps({k: v.state_dict() for k, v in extras.items()})}}
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()  # every rank's part is on disk before the folder is published
    if rank == 0:
        C.finalize_checkpoint(root, step)
    return str(final)


def load(path: str, local: Mapping[str, object], manifest, mesh, extras: Mapping[str, object]) -> int:
    """Fill `local` (views of the model's and optimizer's tensors, built for this layout) and `extras` from
    the checkpoint `path`; every rank of the training world calls it. Returns the step it holds."""
    import torch.distributed.checkpoint as dcp

    state = {"state": _pieces(local, manifest, mesh), "run": {"step": 0, "extras": b""}}
    dcp.load(state, checkpoint_id=path)
    saved = pickle.loads(state["run"]["extras"])
    missing = sorted(set(extras) - set(saved))
    if missing:
        raise RuntimeError(f"checkpoint {path} holds no state for the registered objects {missing}")
    for k, obj in extras.items():
        obj.load_state_dict(saved[k])
    return int(state["run"]["step"])
