"""PUBLIC: what a training script imports to run in LIVE mode under elastic-launch.

Live mode moves the training state directly between the running workers when the job is
resized; no step is lost or repeated. The script says how to build its model for a layout and
runs its own step; at every step boundary it hands control to the runtime:

    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from launcher import runtime

    job = runtime.join(
        model=lambda layout: MyModel(),                  # built with the same seed on every rank
        tp_plan={"up": ColwiseParallel(), "down": RowwiseParallel()},  # parallelize_module's plan
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.99 ** s),  # job.scheduler
        state={"data": loader},                          # anything with state_dict/load_state_dict
    )
    while job.next_step(until=100):                      # the step boundary: migrations happen here
        with job.guard():                                # a step another worker's death broke is abandoned
            loss = job.model(batch(job.step, job.layout)).sum()
            job.optimizer.zero_grad(); loss.backward()
            job.reduce_gradients()                       # DP all-reduce (mean)
            job.clip_grad_norm_(1.0)                     # optional: torch's clipping, by the whole model's norm
            job.optimizer.step()                         # applied by every rank or by none
            job.scheduler.step()
            if job.layout.rank == 0:
                job.report_loss(loss)                    # the job's loss timeline (elastic history, dashboard)

`job.clip_grad_norm_(max_norm, norm_type=2.0)` is torch.nn.utils.clip_grad_norm_ for a model cut by the layout
(torch's own fails on a tp_plan's mix of DTensor and plain parameters, and sees one pipeline stage): the
total norm is the unsharded model's (TP pieces summed over the TP group, replicated ones counted once, stages
summed over pp_group, DP replicas not summed), returned, and every gradient is scaled by
min(1, max_norm / (total + 1e-6)) (launcher.runtime.clip).

`job.layout` says where this process stands (launcher.runtime.layout.Layout): `pp`, `tp`, `dp` and
their ranks, `rank`, `world_size`, `mesh` (a (pp, dp, tp) DeviceMesh), `tp_mesh`, `dp_group`,
`pp_group`, `prev_rank`/`next_rank` (the neighbouring stages), `is_first_stage`/`is_last_stage`.
The state that moves is the torch-native one: the model's `state_dict` (DTensor placements
Shard(d)/Replicate from `tp_plan`), the optimizer's per-parameter state (any torch.optim optimizer: what
it keeps is learnt by stepping the factory on zero-size probes, migrate.optim_state; LBFGS and SparseAdam
are refused) and its settings (each
parameter group's lr, betas, weight_decay, any key), the declared `scheduler`'s state, and every
object in `state` (its `state_dict()`, e.g. a data position, an RNG). `job.optimizer` is one object
from `join` on: each layout's parameters and state are put into it, so a scheduler or a wrapper made
on it keeps working across migrations. Declare the LR scheduler to `join` (`scheduler=`, any
torch.optim.lr_scheduler, chained or sequential too) rather than making it on `job.optimizer` yourself:
a worker that joins later gets the declared one's state handed over, a scheduler of its own would
start from the beginning. Every step's commit vote compares the step and each parameter group's lr and other
scalar settings across the training world (launcher.runtime.vote, no extra message): where they differ the
job stops with one line naming the cause and the fix, instead of its replicas training apart in silence. `job.model` is each layout's own module (None until this worker trains).
Checkpoints hold the model, the optimizer's state and settings, the scheduler and `state`'s objects, so a
restore from one goes on with the schedule. The manifest of a
layout no process holds yet comes from building the model on the meta device
(migrate.manifest.stage_manifests, one per (pp, tp) rank), so only what changes owner moves.

PIPELINE PARALLELISM (layouts with pp > 1, e.g. `--layouts pp2dp2,pp1dp2`): `model(layout)` builds
only this rank's stage, with the model's GLOBAL names: build the whole model with the same seed,
then `runtime.keep_stage_blocks(model.blocks, layout)` (the other stages' blocks become
nn.Identity) and set the embedding/head a stage does not own to None (torchtitan's way; see
launcher.runtime.layout). Run the stage with `runtime.Pipeline(job, microbatches, loss_fn)`
(torch.distributed.pipelining's GPipe on `layout.pp_group`, rebuilt after every migration):

    pipe = runtime.Pipeline(job, microbatches=2, loss_fn=nn.functional.mse_loss)
    while job.next_step(until=100):
        with job.guard():
            job.optimizer.zero_grad()
            loss = pipe.step(x, y)                       # x feeds the first stage, y the last; every stage gets the loss
            job.reduce_gradients(); job.optimizer.step()

A script with its own schedule uses `layout.pp_group`, `prev_rank` and `next_rank` instead.

Failures: every `optimizer.step()` commits all-or-nothing across the training world (a pre-step hook
votes, launcher.runtime.faults). When a worker dies, the survivors' step fails inside `job.guard()`,
which abandons it (state, step count and registered objects stay those of the last committed step);
the launcher then moves the job onto the survivors from the DP replicas left (migrate.reshard takes
every piece from a surviving holder), or, when no replica covers the lost state, restarts it from
the job's safety checkpoint ($ELASTIC_CHECKPOINT_EVERY; launcher.runtime.ckpt: DCP of the state
dicts). Without `job.guard()` the survivors end too, and only the checkpoint can recover the job.
Suspend (`elastic suspend`, USR1 with --on-signal suspend) writes that checkpoint at one step
boundary and ends the workers; `elastic-launch --resume` goes on from it on any layout.

A program that never calls `runtime.join(...)` runs in RESTART mode (torchrun's contract; see the
guide's "Restart mode", docs/guides/restart-mode.md). One that calls it but never reaches `job.next_step()` is named by the launcher. A restart-mode
script may say its progress with `runtime.report_step(step, loss=None)` on rank 0 (launcher.runtime.report:
`elastic jobs`' STEP, each restart's step and steps run again; a no-op outside elastic-launch).
"""
from launcher.runtime.job import JOIN_CALL, STEP_CALL, Job, join
from launcher.runtime.layout import Layout, keep_stage_blocks, parse_layout
from launcher.runtime.pipeline import Pipeline
from launcher.runtime.report import report_step

__all__ = ["JOIN_CALL", "STEP_CALL", "Job", "Layout", "Pipeline", "join", "keep_stage_blocks", "parse_layout",
           "report_step"]
