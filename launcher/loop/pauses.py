"""The pause a migration causes, as the user sees it: from the last step the old layout committed to
the first step the new layout committed. Rank 0 stamps both on the control store when a step's
commit vote succeeds (Control.stamp_commit, launcher.runtime.vote); the launcher reads them once the new layout's first
step is in, which is after the migration itself finished, so pauses are settled on later polls."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Pending:
    migration_id: int
    old_world: str
    new_world: str
    outcome: object  # the launcher's Outcome (launcher.loop.outcome), given its pause_s once known


class PendingPauses:
    """Migrations whose new layout has not committed a step yet."""

    def __init__(self) -> None:
        self.items: list[_Pending] = []

    def add(self, migration_id: int, old_world: str, new_world: str, outcome: object) -> None:
        self.items.append(_Pending(migration_id, old_world, new_world, outcome))

    def settle(self, ctl, db, log=None) -> None:
        """Record the pause of every migration whose new layout has committed its first step."""
        left = []
        for p in self.items:
            first = ctl.commit_times(p.new_world)[0]
            if first is None:
                left.append(p)
                continue
            last = ctl.commit_times(p.old_world)[1]
            if last is None:  # the old layout never committed a step: nothing stood still
                continue
            pause = max(first - last, 0.0)
            db.set_pause(p.migration_id, pause)
            p.outcome.pause_s = pause
            if log is not None:
                log(f"migration {p.migration_id}: training paused {pause:.3f} s (last step on "
                    f"{p.outcome.from_layout} to the first on {p.outcome.to_layout})")
        self.items = left
