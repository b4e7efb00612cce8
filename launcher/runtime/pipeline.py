"""PUBLIC (through launcher.runtime): run the job's pipeline stage with torch.distributed.pipelining.

`Pipeline(job, microbatches, loss_fn)` wraps `PipelineStage` + a schedule (GPipe by default) for
the stage the runtime built (`job.model`) on the pipeline group of the current layout
(`job.layout.pp_group`). After a migration the stage, the layout and the groups are new, so the
schedule is rebuilt at the first step that sees a new `job.model`; the script keeps calling
`pipe.step(x, y)` across resizes. With pp = 1 the schedule runs one stage that is first and last.

torch.distributed.pipelining works on gloo (CPU) in torch 2.13: checked with 1, 2 and 4 stages,
gradients and losses bit-identical to one process running the same microbatches (GPipe sums the
microbatch gradients in order, then divides by their number). So the runtime uses it rather than a
stage split of its own.
"""
from __future__ import annotations

from collections.abc import Callable


class Pipeline:
    """One training step of the pipeline: forward and backward of every microbatch; the gradients are
    left in the stage's parameters (then `job.reduce_gradients()` and `job.optimizer.step()`)."""

    def __init__(self, job, microbatches: int, loss_fn: Callable, schedule: type | None = None) -> None:
        self.job, self.microbatches, self.loss_fn = job, microbatches, loss_fn
        self.schedule_class = schedule
        self._model = self._schedule = None

    def _current(self):
        if self._model is not self.job.model:
            import torch
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            lay = self.job.layout
            stage = PipelineStage(self.job.model, lay.pp_rank, lay.pp, torch.device("cpu"), group=lay.pp_group)
            self._schedule = (self.schedule_class or ScheduleGPipe)(stage, n_microbatches=self.microbatches,
                                                                    loss_fn=self.loss_fn)
            self._model = self.job.model
        return self._schedule

    def step(self, inputs, target):
        """Run the step: `inputs` feed the first stage, `target` the loss on the last (each is read only on
        its stage; every stage may pass the same global values). The batch is split along dim 0 into
        `microbatches` equal chunks. Returns the step's loss (the mean of the microbatch losses) on every
        stage of this pipeline (broadcast from the last)."""
        import torch
        import torch.distributed as dist

        lay = self.job.layout
        sched = self._current()
        args = (inputs,) if lay.is_first_stage else ()
        losses: list = []
        kwargs = {"target": target, "losses": losses} if lay.is_last_stage else {}
        sched.step(*args, **kwargs)
        loss = torch.stack([x.detach() for x in losses]).mean() if losses else torch.zeros(())
        if lay.pp > 1:
            last = dist.get_global_rank(lay.pp_group, lay.pp - 1)
            dist.broadcast(loss, src=last, group=lay.pp_group)
        return loss
