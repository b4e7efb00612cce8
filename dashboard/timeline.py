"""A job's timeline: its layouts, each migration with its pause, the step rate and the loss curve the
workers report, as three server-rendered SVG charts on one axis, the training step (migrations drawn as
marks on each at the step they applied at; wall-clock time for a job that reports no steps). Pure: it
takes what the Store returns and gives chart geometry."""
from __future__ import annotations

from bisect import bisect_right
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
    axis: str = "step"  # what x is: the training step, or wall-clock "time" for a job that reports no steps


def pause_of(m: Migration) -> tuple[float | None, str]:
    """(seconds, what they are): the measured pause when the launcher recorded one, else the
    migration's duration (an upper bound: training may have gone on while it planned)."""
    if m.pause_s is not None:
        return m.pause_s, "pause"
    return m.duration_s, "duration"


def step_rates(steps: Sequence[StepRecord], window: int = RATE_WINDOW) -> list[tuple[float, float]]:
    """(step, steps per second) over sliding windows of `window` reported steps; fewer where fewer were
    reported (a short job, or a launcher that polled slower than the steps: one window less than there are
    reports, down to consecutive reports), so a job with a handful of reports still gets a line. Steps the
    launcher recorded at one poll share its time: a window inside one poll has no rate."""
    window = max(1, min(window, len(steps) // 2))
    out = []
    for i in range(window, len(steps)):
        a, b = steps[i - window], steps[i]
        dt = (b.at - a.at).total_seconds()
        if dt > 0 and b.step > a.step:
            out.append((float(b.step), (b.step - a.step) / dt))
    return out


def _clock(x: float) -> str:
    return datetime.fromtimestamp(x, timezone.utc).strftime("%H:%M:%S")


def step_axis(steps: Sequence[StepRecord]) -> Callable[[datetime], float]:
    """The training step a moment belongs to: the last step recorded by then (0 before the first)."""
    times = [s.at for s in steps]

    def at(t: datetime) -> float:
        i = bisect_right(times, t)
        return float(steps[i - 1].step) if i else 0.0

    return at


def timeline(maps: Sequence[RankMap], migrations: Sequence[Migration], steps: Sequence[StepRecord],
             now: datetime, href: Callable[[int], str] = lambda mid: f"/migrations/{mid}") -> Timeline:
    """Charts for one job on one axis: the training step where the workers reported steps (a migration is
    drawn at the step it applied at), else wall-clock time (restart mode reports none); `href(migration id)`
    is each migration band's link."""
    by_step = bool(steps)
    x_of = step_axis(steps) if by_step else (lambda t: t.timestamp())
    ends = [m.ended_at or now for m in maps]
    bands = []
    for m in sorted(migrations, key=lambda m: m.started_at):
        secs, what = pause_of(m)
        label = f"#{m.id} {m.from_layout}→{m.to_layout}" + (f" {what} {secs:.2f} s" if secs is not None else "")
        if by_step:  # at the step boundary it applied at (or, not applied, where training was when it began)
            x0 = float(m.at_step) if m.at_step is not None else x_of(m.started_at)
            x1 = x0
        else:
            x0, x1 = m.started_at.timestamp(), (m.finished_at or now).timestamp()
        bands.append((x0, x1, label, BAND_COLOURS.get(m.status, "#cbd5e1"), href(m.id)))
    devices = [(x_of(m.started_at), float(len(m.entries))) for m in maps]
    if maps:
        devices.append((float(steps[-1].step) if by_step else ends[-1].timestamp(), float(len(maps[-1].entries))))
    xs = ([x for x, _ in devices] + [b for x0, x1, *_ in bands for b in (x0, x1)]
          + ([float(s.step) for s in steps] if by_step else [t.timestamp() for t in ends]))
    common = {"x_range": (min(xs), max(xs)) if xs else None, "height": 150,
              "x_text": (lambda x: f"{x:.0f}") if by_step else _clock}
    return Timeline(
        layouts=line_chart([("devices", "#047857", devices)], bands, step=True,
                           y_text=lambda y: f"{y:.0f}", **common),  # type: ignore[arg-type]
        rate=line_chart([("steps/s", "#1d4ed8", step_rates(steps))], bands, **common),  # type: ignore[arg-type]
        loss=line_chart([("loss", "#b91c1c", [(float(s.step), s.loss) for s in steps if s.loss is not None])],
                        bands, y_min=None, **common),  # type: ignore[arg-type]
        epochs=tuple((m.epoch, m.layout, len(m.entries), m.started_at, m.ended_at) for m in maps),
        axis="step" if by_step else "time",
    )
