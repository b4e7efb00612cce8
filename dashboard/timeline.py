"""A job's timeline: its layouts over time, each migration with its pause, the step rate and the loss
curve the workers report, as three server-rendered SVG charts on one time axis (migrations drawn
as bands on each). Pure: it takes what the Store returns and gives chart geometry."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Sequence

from dashboard.linechart import LineChart, line_chart
from db.records import Migration, RankMap, StepRecord

BAND_COLOURS = {"succeeded": "#f59e0b", "failed": "#ef4444", "declined": "#94a3b8", "running": "#a78bfa", "planned": "#cbd5e1"}
RATE_WINDOW = 5  # steps per rate sample: smooths single slow steps without hiding a migration


@dataclass(frozen=True)
class Timeline:
    layouts: LineChart
    rate: LineChart
    loss: LineChart
    epochs: tuple[tuple[int, str, int, datetime, datetime | None], ...]  # (epoch, layout, devices, from, to)


def pause_of(m: Migration) -> tuple[float | None, str]:
    """(seconds, what they are): the measured pause when the launcher recorded one, else the
    migration's duration (an upper bound: training may have gone on while it planned)."""
    if m.pause_s is not None:
        return m.pause_s, "pause"
    return m.duration_s, "duration"


def step_rates(steps: Sequence[StepRecord], window: int = RATE_WINDOW) -> list[tuple[float, float]]:
    """(time, steps per second) over sliding windows of `window` reported steps; fewer where fewer were
    reported (a short job, or a launcher that polled slower than the steps: one window less than there are
    reports, down to consecutive reports), so a job with a handful of reports still gets a line."""
    window = max(1, min(window, len(steps) // 2))
    out = []
    for i in range(window, len(steps)):
        a, b = steps[i - window], steps[i]
        dt = (b.at - a.at).total_seconds()
        if dt > 0 and b.step > a.step:
            out.append((b.at.timestamp(), (b.step - a.step) / dt))
    return out


def _clock(x: float) -> str:
    return datetime.fromtimestamp(x, timezone.utc).strftime("%H:%M:%S")


def timeline(maps: Sequence[RankMap], migrations: Sequence[Migration], steps: Sequence[StepRecord],
             now: datetime, href: Callable[[int], str] = lambda mid: f"/migrations/{mid}") -> Timeline:
    """Charts for one job; `href(migration id)` is each migration band's link."""
    ends = [m.ended_at or now for m in maps]
    times = ([m.started_at.timestamp() for m in maps] + [e.timestamp() for e in ends]
             + [s.at.timestamp() for s in steps]
             + [t.timestamp() for m in migrations for t in (m.started_at, m.finished_at or now)])
    x_range = (min(times), max(times)) if times else None
    bands = []
    for m in sorted(migrations, key=lambda m: m.started_at):
        secs, what = pause_of(m)
        label = f"#{m.id} {m.from_layout}→{m.to_layout}" + (f" {what} {secs:.2f} s" if secs is not None else "")
        bands.append((m.started_at.timestamp(), (m.finished_at or now).timestamp(), label,
                      BAND_COLOURS.get(m.status, "#cbd5e1"), href(m.id)))
    devices = [(m.started_at.timestamp(), float(len(m.entries))) for m in maps]
    if maps:
        devices.append((ends[-1].timestamp(), float(len(maps[-1].entries))))
    common = {"x_range": x_range, "x_text": _clock, "height": 150}
    return Timeline(
        layouts=line_chart([("devices", "#047857", devices)], bands, step=True,
                           y_text=lambda y: f"{y:.0f}", **common),  # type: ignore[arg-type]
        rate=line_chart([("steps/s", "#1d4ed8", step_rates(steps))], bands, **common),  # type: ignore[arg-type]
        loss=line_chart([("loss", "#b91c1c", [(s.at.timestamp(), s.loss) for s in steps if s.loss is not None])],
                        bands, y_min=None, **common),  # type: ignore[arg-type]
        epochs=tuple((m.epoch, m.layout, len(m.entries), m.started_at, m.ended_at) for m in maps),
    )
