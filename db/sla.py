"""GPU-fraction SLA (Singularity's metric): ideal time / real time.

Ideal time is how long the work done would have taken on `max_devices`. Work is counted
in device-seconds from rank-map epochs, excluding any time spent inside a migration
(the job makes no progress there). Real time runs from the first epoch's start to `end`.
So time on fewer devices, time in migrations and gaps without a rank map all count as lost.
"""
from __future__ import annotations

from datetime import datetime
from typing import Iterable, Sequence

Interval = tuple[datetime, datetime]


def _merge(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _seconds_outside(span: Interval, holes: Sequence[Interval]) -> float:
    """Seconds of `span` not covered by the (merged, sorted) `holes`."""
    start, end = span
    total = (end - start).total_seconds()
    for h_start, h_end in holes:
        lo, hi = max(start, h_start), min(end, h_end)
        if hi > lo:
            total -= (hi - lo).total_seconds()
    return max(total, 0.0)


def gpu_fraction(
    epochs: Sequence[tuple[datetime, datetime | None, int]],
    migrations: Sequence[tuple[datetime, datetime | None]],
    max_devices: int,
    end: datetime,
) -> float | None:
    """SLA in [0, 1], or None when there is nothing to measure yet.

    epochs: (started_at, ended_at or None if current, devices in use).
    migrations: (started_at, finished_at or None if still running).
    """
    if not epochs or max_devices <= 0:
        return None
    first = min(e[0] for e in epochs)
    real = (end - first).total_seconds()
    if real <= 0:
        return None
    holes = _merge((s, f or end) for s, f in migrations)
    device_seconds = 0.0
    for start, stop, devices in epochs:
        span = (start, min(stop or end, end))
        if span[1] > span[0]:
            device_seconds += min(devices, max_devices) * _seconds_outside(span, holes)
    ideal = device_seconds / max_devices
    return max(0.0, min(1.0, ideal / real))
