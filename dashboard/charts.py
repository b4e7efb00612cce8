"""Geometry for the server-rendered SVG bar charts (the template only draws rectangles).

Computing layout here keeps templates dumb and lets tests check numbers, not pixels.
"""
from __future__ import annotations

from dataclasses import dataclass

from db.units import human_bytes
from db.vocab import PHASES

PHASE_COLOURS = {"plan": "#6366f1", "build_groups": "#0ea5e9", "execute": "#f59e0b",
                 "rebuild": "#10b981", "other": "#94a3b8"}


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    text: str
    x: float
    y: float
    width: float
    height: float
    colour: str


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    label_width: int
    bars: tuple[Bar, ...]


def hbar_chart(items: list[tuple[str, float, str, str]], width: int = 520, row: int = 26,
               label_width: int = 110) -> Chart:
    """Horizontal bars scaled to the largest value; items are (label, value, text, colour)."""
    top = max((v for _, v, _, _ in items), default=0.0) or 1.0
    span = width - label_width - 90
    bars = tuple(Bar(label, value, text, label_width, i * row + 4, max(span * value / top, 1.0 if value else 0.0),
                     row - 8, colour) for i, (label, value, text, colour) in enumerate(items))
    return Chart(width, row * max(len(items), 1) + 4, label_width, bars)


def phase_chart(phases: dict[str, float]) -> Chart:
    """Per-phase seconds, in pipeline order, then any total."""
    order = [p for p in PHASES if p in phases] + sorted(set(phases) - set(PHASES))
    return hbar_chart([(p, phases[p], f"{phases[p]:.3f} s", PHASE_COLOURS.get(p, "#94a3b8")) for p in order])


def bytes_chart(moved: int | None, checkpoint: int | None) -> Chart:
    """Bytes moved by direct migration next to what a checkpoint restart would move."""
    items = []
    if moved is not None:
        items.append(("moved", float(moved), human_bytes(moved), "#10b981"))
    if checkpoint is not None:
        items.append(("checkpoint", float(checkpoint), human_bytes(checkpoint), "#ef4444"))
    return hbar_chart(items)
