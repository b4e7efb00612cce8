"""The plain jobs of a scripted stretch of cluster time, from a fixed seed.

Why generated, not recorded: both runs (manual, opportunistic) must see exactly the same arrivals, and a user
must be able to vary the load (`--seed`, `--seconds`) and get the same trace again. Arrivals are a Poisson
process, sizes and run times are drawn from small fixed distributions; pure, no Slurm."""
from __future__ import annotations

import random
from dataclasses import dataclass

SIZES = (1, 1, 2, 2, 3)  # nodes a plain job asks for (whole nodes, --exclusive); never all of them
RUN_S = (15.0, 45.0)  # how long one runs, uniform
MEAN_GAP_S = 35.0  # mean time between two arrivals
FIRST_AT_S = 20.0  # nothing arrives before this (the elastic job has started and, if it may, grown)


@dataclass(frozen=True)
class PlainJob:
    index: int
    at_s: float  # when it is submitted, from the trace's start
    nodes: int
    run_s: float


def make_trace(seed: int, seconds: float, max_nodes: int = 3) -> tuple[PlainJob, ...]:
    """The plain jobs submitted in [FIRST_AT_S, seconds), sizes capped at `max_nodes`."""
    rng = random.Random(seed)
    jobs, t = [], FIRST_AT_S
    while t < seconds:
        jobs.append(PlainJob(len(jobs), round(t, 1), min(rng.choice(SIZES), max_nodes),
                             round(rng.uniform(*RUN_S), 1)))
        t += rng.expovariate(1.0 / MEAN_GAP_S)
    return tuple(jobs)
