"""Figures of one run from what was sampled: pure, so they are tested without a cluster.

A sample is the queue at one moment (every RUNNING job's node count, by Slurm job id). Utilisation is the
time-average of the nodes allocated to any job (plain or elastic), capped at the cluster's nodes, over the
trace's window: the elastic job asks 2 of each node's 4 GPUs (2 worker processes per node on this machine's 2
cores) and a plain job takes its nodes whole (--exclusive), so a node is the unit either way. A plain job's
wait is from its submission to the first sample that shows it running."""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    t: float  # seconds from the trace's start
    running: Mapping[int, int]  # Slurm job id -> nodes, every RUNNING job


def utilisation(samples: Sequence[Sample], total_nodes: int, start: float, end: float) -> float:
    """Time-weighted share of the cluster's nodes allocated in [start, end] (each sample holds until the next)."""
    inside = [s for s in samples if start <= s.t <= end]
    if len(inside) < 2 or end <= start:
        return 0.0
    used = 0.0
    for a, b in zip(inside, inside[1:]):
        used += min(sum(a.running.values()), total_nodes) * (b.t - a.t)
    return used / (total_nodes * (inside[-1].t - inside[0].t))


def waits(submitted: Mapping[int, float], samples: Sequence[Sample]) -> dict[int, float | None]:
    """Slurm job id -> seconds from submission to first seen running (None: never seen running)."""
    first: dict[int, float] = {}
    for s in samples:
        for job in s.running:
            first.setdefault(job, s.t)
    return {job: (round(first[job] - at, 1) if job in first else None) for job, at in submitted.items()}


@dataclass(frozen=True)
class WaitFigures:
    median_s: float | None
    max_s: float | None
    never_started: int


def wait_figures(w: Mapping[int, float | None]) -> WaitFigures:
    started = [v for v in w.values() if v is not None]
    return WaitFigures(round(statistics.median(started), 1) if started else None,
                       round(max(started), 1) if started else None, sum(v is None for v in w.values()))


def sample_steps(rows: Sequence[tuple[int, float, str]]) -> tuple[int, int]:
    """(steps, replica-steps) of a loss file's rows (step, loss, layout): replica-steps count each step once per
    DP replica, the work a larger layout does per step."""
    from migrate.layout import ParallelConfig

    if not rows:
        return 0, 0
    return len(rows), sum(ParallelConfig.parse(layout).dp for _s, _l, layout in rows)
