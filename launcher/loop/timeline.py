"""Where a migration's pause goes: every worker's marks (launcher.wire.control: `mark`, sent with its result)
laid out against the pause, from the old layout's last committed step (time 0) to the new layout's
first committed step (the end of the pause, `elastic bench --explain`).

The critical path is read off the marks in the order a migration passes through them: each segment
is how much later the LAST worker reached a mark than the last worker reached the one before, so the
segments add up to the pause and say which stage held everybody up (a straggler shows as its row).
Planning (`build`) is pure; `read` collects what the workers reported from the control store.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: the marks a migration passes through, in order: (column, mark name with {m}/{w} for the worlds, what it means)
STAGES = (
    ("voted", "voted", "finished its last step on the old layout (its commit vote)"),
    ("boundary", "boundary", "saw that step commit and started the migration"),
    ("met m", "met {m}", "every member of the migration world had arrived"),
    ("formed m", "formed {m}", "the migration world's process group was formed"),
    ("moved", "moved", "its transfer was done and verified"),
    ("agreed", "agreed", "the migration committed"),
    ("formed w", "formed {w}", "the new layout's process group was formed"),
    ("built", "built", "its trainer was rebuilt on the new layout"),
    ("1st vote", "first voted", "finished its first step on the new layout"),
)


@dataclass(frozen=True)
class Timeline:
    """Marks of one migration, in seconds after the old layout's last commit."""

    pause_s: float
    rows: dict[int, dict[str, float]]  # device -> column -> seconds (missing: the worker did not pass there)
    roles: dict[int, str]  # device -> "old->new" ranks, e.g. "3->5", "-->2" (joiner), "4->-" (leaving)

    def critical_path(self) -> dict[str, float]:
        """Segment -> seconds: how long the slowest worker took from one stage to the next; sums to the pause."""
        out, prev = {}, 0.0
        for col, _name, _what in STAGES[1:]:
            times = [r[col] for r in self.rows.values() if col in r]
            if not times:
                continue
            t = max(max(times), prev)
            out[col] = t - prev
            prev = t
        out["1st commit"] = max(self.pause_s - prev, 0.0)
        return out


def build(last_commit: float, first_commit: float, marks: Mapping[int, Mapping[str, float]],
          first_steps: Mapping[int, Mapping[str, float]], old_world: str, new_world: str, epoch: int,
          old_devices: tuple[int, ...], new_devices: tuple[int, ...]) -> Timeline:
    """The timeline of migration event `epoch` from the workers' marks (wall times)."""
    names = {col: name.format(m=f"m{epoch}", w=new_world) for col, name, _ in STAGES}
    rows: dict[int, dict[str, float]] = {}
    for d in sorted(set(marks) | set(first_steps)):
        got = dict(marks.get(d, {}))
        if d in first_steps:
            got["first voted"] = first_steps[d]["voted"]
        if d not in old_devices:  # a joiner's vote and commit marks are from no step of the old layout
            got.pop("voted", None)
        rows[d] = {col: got[name] - last_commit for col, name in names.items() if name in got}
    roles = {d: f"{old_devices.index(d) if d in old_devices else '-'}->"
                f"{new_devices.index(d) if d in new_devices else '-'}" for d in rows}
    return Timeline(first_commit - last_commit, rows, roles)


def read(ctl, out, old_devices: tuple[int, ...], new_devices: tuple[int, ...]) -> Timeline | None:
    """The timeline of a finished migration (a launcher Outcome whose pause is known), from the store."""
    if out.worlds is None:
        return None
    old, new = out.worlds
    epoch = int(new.removeprefix("w"))
    last, first = ctl.commit_times(old)[1], ctl.commit_times(new)[0]
    if last is None or first is None:
        return None
    return build(last, first, out.marks, ctl.first_step_marks(new, new_devices), old, new, epoch,
                 old_devices, new_devices)


def explain(tl: Timeline) -> str:
    """A per-worker table of the marks and the critical path, for people."""
    cols = [c for c, _n, _w in STAGES]
    head = f"{'device':>6} {'ranks':>7} " + " ".join(f"{c:>9}" for c in cols)
    lines = [f"pause {tl.pause_s:.2f} s, seconds after the old layout's last committed step:", head]
    for d, row in tl.rows.items():
        lines.append(f"{d:>6} {tl.roles[d]:>7} " + " ".join(f"{row[c]:>9.2f}" if c in row else f"{'':>9}"
                                                            for c in cols))
    lines.append("critical path: " + ", ".join(f"{k} {v:.2f}" for k, v in tl.critical_path().items())
                 + f" (= {tl.pause_s:.2f} s)")
    lines.append("columns: " + "; ".join(f"{c}: {w}" for c, _n, w in STAGES))
    return "\n".join(lines)
