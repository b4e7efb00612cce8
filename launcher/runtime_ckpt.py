"""Checkpoints of a live-mode job (launcher.runtime): the torch-native state written with DCP.

What is written is what moves in a live migration: the model's and optimizer's state dicts
(torch.distributed.checkpoint.state_dict: FQN keys, DTensor shards of `parallelize_module`),
every registered object's `state_dict()` and the number of finished steps. DCP writes each piece
once (DP replicas are deduplicated) and a load on another layout reads only the slices it needs,
so a job suspended on tp2dp2 can resume on tp2dp1. Folders follow launcher.control's convention:
DIR/.tmp-step-<S> while it is written, renamed to DIR/step-<S> by rank 0 once every rank's part is
on disk (a safety checkpoint, or the one a suspend leaves).
"""
from __future__ import annotations

import pickle
from collections.abc import Mapping

from launcher import control as C


def _bundle(model, optimizer, extras: Mapping[str, object], step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd, "run": {"step": step,
                                                "extras": pickle.dumps({k: v.state_dict() for k, v in extras.items()})}}


def save(root: str, model, optimizer, extras: Mapping[str, object], step: int, rank: int) -> str:
    """Every rank of the training world calls it at the same step boundary; returns the final folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tmp, final = C.checkpoint_paths(root, step)
    dcp.save(_bundle(model, optimizer, extras, step), checkpoint_id=str(tmp))
    dist.barrier()  # every rank's part is on disk before the folder is published
    if rank == 0:
        C.finalize_checkpoint(root, step)
    return str(final)


def load(path: str, model, optimizer, extras: Mapping[str, object]) -> int:
    """Fill `model`, `optimizer` (built for this layout, optimizer state created) and `extras` from the
    checkpoint `path`; every rank of the training world calls it. Returns the step it holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _bundle(model, optimizer, extras, 0)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    saved = pickle.loads(sd["run"]["extras"])
    missing = sorted(set(extras) - set(saved))
    if missing:
        raise RuntimeError(f"checkpoint {path} holds no state for the registered objects {missing}")
    for k, obj in extras.items():
        obj.load_state_dict(saved[k])
    return int(sd["run"]["step"])
