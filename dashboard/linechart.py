"""Geometry for server-rendered SVG line charts over time (fragmentation history, a job's loss
curve and step rate, with migrations drawn as bands). The template only draws what this returns,
so tests check numbers, not pixels; no JavaScript, nothing for a CSP to block."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

Point = tuple[float, float]


@dataclass(frozen=True)
class Line:
    label: str
    colour: str
    path: str  # SVG path data, "" when the series is empty
    points: tuple[Point, ...]  # pixel coordinates (for markers and tests)


@dataclass(frozen=True)
class Band:
    """A time span drawn as a shaded rectangle (a migration), with a label and a link target. `text` is what
    is written on the chart, in row `row` (0: the top line): the whole label where it fits, its first word
    (e.g. "#12") where only that does, nothing where neither does (the label stays the rectangle's tooltip)."""

    x: float
    width: float
    label: str
    colour: str
    href: str = ""
    text: str = ""
    row: int = 0


LABEL_ROWS = 3  # lines of band labels under the chart's top edge
CHAR_PX = 5.6  # the width of one character at font-size 10 (a little generous: labels must not touch)


@dataclass(frozen=True)
class Tick:
    pos: float
    text: str


@dataclass(frozen=True)
class LineChart:
    width: int
    height: int
    left: int
    top: int
    plot_w: int
    plot_h: int
    lines: tuple[Line, ...]
    bands: tuple[Band, ...]
    x_ticks: tuple[Tick, ...]
    y_ticks: tuple[Tick, ...]
    empty: bool


def _ticks(lo: float, hi: float, n: int) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def line_chart(series: Sequence[tuple[str, str, Sequence[Point]]],
               bands: Sequence[tuple[float, float, str, str, str]] = (),
               *, width: int = 640, height: int = 200, y_min: float | None = 0.0, y_max: float | None = None,
               x_range: tuple[float, float] | None = None, step: bool = False,
               x_text: Callable[[float], str] = lambda x: f"{x:.0f}",
               y_text: Callable[[float], str] = lambda y: f"{y:.3g}") -> LineChart:
    """Lines for `series` = [(label, colour, [(x, y), ...])] and `bands` = [(x0, x1, label, colour,
    href)], on shared axes that cover every point and band; y from y_min (None: the data's
    minimum) to y_max (None: the data's maximum); x over x_range when given (charts stacked on one
    time axis), else over the data. step=True draws a staircase (a value that holds until the next)."""
    left, top, right, bottom = 56, 8, 28, 24
    pw, ph = width - left - right, height - top - bottom
    xs = [x for _, _, pts in series for x, _ in pts] + [b for x0, x1, *_ in bands for b in (x0, x1)]
    ys = [y for _, _, pts in series for _, y in pts]
    if not xs:
        return LineChart(width, height, left, top, pw, ph, (), (), (), (), True)
    x0, x1 = x_range or (min(xs), max(xs))
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    lo = (min(ys) if ys else 0.0) if y_min is None else y_min
    hi = (max(ys) if ys else 1.0) if y_max is None else y_max
    if hi <= lo:
        hi = lo + 1.0

    def px(x: float) -> float:
        return round(left + (x - x0) / (x1 - x0) * pw, 1)

    def py(y: float) -> float:
        return round(top + ph - (min(max(y, lo), hi) - lo) / (hi - lo) * ph, 1)

    lines = []
    for label, colour, pts in series:
        coords = tuple((px(x), py(y)) for x, y in sorted(pts))
        path = " ".join(f"{'M' if i == 0 else 'L'}{cx},{cy}" if not (step and i) else f"H{cx} V{cy}"
                        for i, (cx, cy) in enumerate(coords))
        lines.append(Line(label, colour, path, coords))
    drawn = _placed([Band(px(a), max(px(b) - px(a), 2.0), label, colour, href)
                     for a, b, label, colour, href in sorted(bands, key=lambda b: b[0])], left + pw + right)
    return LineChart(width, height, left, top, pw, ph, tuple(lines), drawn,
                     tuple(Tick(px(x), x_text(x)) for x in _ticks(x0, x1, 5)),
                     tuple(Tick(py(y), y_text(y)) for y in _ticks(lo, hi, 3)), False)


def _placed(bands: list[Band], right_edge: float) -> tuple[Band, ...]:
    """Each band's label written where it does not overlap another: in the first of LABEL_ROWS rows where the
    previous label has ended, whole or else as its first word, else not at all (many short migrations side by
    side; every label stays the band's tooltip)."""
    ends = [float("-inf")] * LABEL_ROWS
    out = []
    for b in bands:
        x = b.x + 2
        for text in (b.label, b.label.split(" ", 1)[0]):
            end = x + len(text) * CHAR_PX
            row = next((r for r in range(LABEL_ROWS) if ends[r] + 4 <= x and end <= right_edge), None)
            if row is not None:
                ends[row] = end
                out.append(Band(b.x, b.width, b.label, b.colour, b.href, text, row))
                break
        else:
            out.append(b)
    return tuple(out)
