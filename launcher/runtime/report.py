"""`report_step`: what a RESTART-mode script (torchrun's contract, no `join`) tells elastic-launch of its
progress, one call per step on rank 0. It is optional: without it the job trains the same, but the
launcher cannot know where the script is, since a restart-mode world keeps its steps and checkpoints to
itself. With it, `elastic jobs` shows the job's STEP, each restart's history the step the new world went
on from (the step before its first report: the script's own checkpoint) and the steps it ran again, and
the job's timeline the loss. Outside elastic-launch (plain torchrun, no $ELASTIC_STORE) it does nothing,
so the script runs under either. Live mode has `job.report_loss` instead (its steps are the runtime's)."""
from __future__ import annotations

import functools
import os

from launcher.wire.env import ENV_STORE


def report_step(step: int, loss: float | None = None) -> None:
    """Say that the script finished step `step` (counted from 1: its first step is 1), with its loss if
    given; call it on one rank (RANK 0) after the step. Costs one message to the launcher, no answer."""
    ctl = _control()
    if ctl is not None:
        ctl.report_loss(int(step), None if loss is None else float(loss),
                        f"pp1tp1dp{os.environ.get('WORLD_SIZE', '1')}")


@functools.cache
def _control():
    if not os.environ.get(ENV_STORE):
        return None
    from launcher.wire.control import Control

    return Control.from_env()
