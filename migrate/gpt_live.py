"""The reference GPT for the public runtime API (launcher.runtime): its stage builder and its manifest.

The reference model (migrate.gpt.GPTStage) shards itself Megatron-style: every rank holds plain
tensors that are its TP shard, under the model's global names (`layers.5.mlp.fc1.weight` on the
stage that holds layer 5). Through the runtime it is one producer of state manifests among others:
`stage_manifest` says what a rank of a layout holds, named as the runtime exports state
(`state_dict` keys, `optim.state.<name>.<key>` for Adam's moments and step), with migrate.layout's
shard rules (the same as DTensor's Shard(d) chunks when a TP size divides the sharded dimension,
which ModelSpec.check_config requires). `build_stage` builds that rank's stage for a runtime layout,
its weights cut from the seeded full tensors (migrate.state), so every layout starts from one model.

`train_step` runs the reference trainer's step (migrate.train.stage_step: its GPipe schedule over the
layout's neighbouring stages, TP inside the stage, the DP gradient sum) on the runtime's layout and
applies it with the job's optimizer, so every layout computes what one process computes.

`python -m launcher.worker` is this model's program: its loop on `runtime.join` / `job.next_step()` with
this builder, manifest and step (tests/examples/gpt_script.py is the same loop, smallest), and the launcher
checks its layouts against the ModelSpec read from its flags (launcher.loop.live.choose).
"""
from __future__ import annotations

from migrate.layout import ModelSpec, ParallelConfig
from migrate.manifest import Manifest, ShardEntry, gpt_manifest

#: Adam's per-parameter state as torch keeps it (moments shaped like the parameter, a scalar step)
ADAM_MOMENTS, ADAM_SCALARS = ("exp_avg", "exp_avg_sq"), ("step",)


def stage_manifest(model: ModelSpec, cfg: ParallelConfig, rank: int) -> Manifest:
    """What virtual rank `rank` of `cfg` holds through the runtime: parameters, Adam moments and step."""
    if model.dtype != "fp32":
        raise ValueError(f"the reference GPT runs through the runtime in fp32 only (got {model.dtype}): "
                         "mixed precision keeps a master copy the runtime does not move")
    entries = []
    for e in gpt_manifest(model, cfg, rank).entries:
        kind, _, name = e.fqn.partition(".")
        if kind == "param":
            entries.append(ShardEntry(name, e.shape, e.dtype, e.dim, e.index, e.count))
            entries += [ShardEntry(f"optim.state.{name}.{k}", (), "float32") for k in ADAM_SCALARS]
        elif kind in ADAM_MOMENTS:
            entries.append(ShardEntry(f"optim.state.{name}.{kind}", e.shape, e.dtype, e.dim, e.index, e.count))
    return Manifest(tuple(entries))


def build_stage(model: ModelSpec, layout, seed: int = 0):
    """This rank's GPTStage for runtime layout `layout` (its `name`, `rank`, `tp_mesh`; no mesh on the
    meta device), filled with its shard of the seeded initial weights (left empty on the meta device)."""
    import torch

    from migrate.gpt import GPTStage, TPGroup
    from migrate.state import initial_state
    from migrate.workload import rank_workload

    cfg = ParallelConfig.parse(layout.name)
    model.check_config(cfg)
    pp, dp, tp = cfg.coords(layout.rank)
    group = layout.tp_mesh.get_group() if cfg.tp > 1 and getattr(layout, "mesh", None) is not None else None
    tp_ranks = [cfg.rank(pp, dp, t) for t in range(cfg.tp)] if group is not None else []
    stage = GPTStage(model, rank_workload(cfg, layout.rank, model.layers, cfg.tp), TPGroup(group, tp_ranks, tp))
    if torch.empty(0).device.type != "meta":
        stage.load(initial_state(model, cfg, layout.rank, seed).tensors["param"])
    return stage


def train_step(job, model: ModelSpec, tc) -> float | None:
    """One step of the reference trainer through the runtime (call inside `job.guard()`, after
    `job.next_step()`): the data of step `job.step`, forward and backward over the pipeline, gradients
    summed over the DP replicas, `job.optimizer.step()`. The global mean loss on last-stage ranks, else None."""
    from migrate.train import stage_step

    lay = job.layout
    job.optimizer.zero_grad(set_to_none=True)
    loss = stage_step(job.model, model, tc, job.step - 1, lay.dp_rank, lay.dp, lay.prev_rank, lay.next_rank,
                      lay.dp_group if lay.dp > 1 else None)
    job.optimizer.step()
    return float(loss) if lay.is_last_stage else None
