"""A tiny live-mode script (launcher.runtime, pure DP) for tests/launcher/loop/test_grow_race.py.

usage: python grow_race_script.py GATE_DIR STEPS

Rank 0 appends `step layout` to GATE_DIR/steps for every step. A worker started by a grow (its first
event is not 0) touches GATE_DIR/grown at once. On one device the last step ends only after the grow
has started a worker (it touches GATE_DIR/last, then waits for GATE_DIR/grown): so the job reaches its
last step while the launcher is carrying out the grow, every time, with no timing involved. On two
devices a step takes a second, so that the shrink the test asks for at step 2 lands well before the
last step even on a loaded machine (it took 10 steps of 0.1 s once, and the grow was never asked).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

gate, steps = Path(sys.argv[1]), int(sys.argv[2])
if int(os.environ.get("ELASTIC_FIRST_EVENT", "0")) > 0:  # launcher.wire.env.ENV_FIRST_EVENT (before torch loads)
    (gate / "grown").touch()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from launcher import runtime  # noqa: E402


def model(_layout) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Linear(4, 1)


job = runtime.join(model=model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
while job.next_step(until=steps):
    with job.guard():
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(job.step))
        x = x.chunk(job.layout.dp)[job.layout.dp_rank]
        loss = (job.model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        job.optimizer.zero_grad()
        loss.backward()
        job.reduce_gradients()
        job.optimizer.step()
    if job.layout.rank == 0:
        with open(gate / "steps", "a") as f:
            f.write(f"{job.step} {job.layout.name}\n")
    if job.step == steps and job.layout.world_size == 1:
        (gate / "last").touch()
        deadline = time.monotonic() + 120
        while not (gate / "grown").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    time.sleep(1.0 if job.layout.world_size > 1 else 0.1)
