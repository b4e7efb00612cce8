"""Training that stops committing steps with no known cause is said, not waited out in silence.

Why: a worker can hang without dying (a deadlocked data loader, a peer stuck in a collective until its
timeout, a stranger's write on the store); the launcher sees no process end and no node gone, and the job
would sit silent for as long as the collective timeout, or forever. Every poll reads the training world's
last commit (rank 0 stamps it at every step, launcher.runtime.vote); when none came for STALL_STEPS typical
steps (and at least STALL_MIN_S), the launcher says since when and where each worker stands (their
heartbeats), once, and says again when steps come back. A long evaluation or save inside the script looks
the same, so the words say it may be one.
"""
from __future__ import annotations

import time
from collections.abc import Callable

STALL_MIN_S = 30.0  # never sooner than this after the last commit
STALL_STEPS = 20  # ... nor sooner than this many typical steps


class StallWatch:
    """Watches one job's commits, poll by poll (pure but for the clock and the store reads it is given)."""

    def __init__(self, log: Callable[[str], None], clock: Callable[[], float] = time.time) -> None:
        self.log, self.clock = log, clock
        self.step_s: float | None = None  # typical seconds a step (the smoothed gaps between seen commits)
        self._seen: tuple[float, int] | None = None  # (last commit stamp, max step) at the last poll it moved
        self.stalled_since: float | None = None  # set while said stalled

    def check(self, world: str, last_commit: float | None, step: int, where: Callable[[], str]) -> bool:
        """One poll: `last_commit` is the world's latest commit stamp, `step` the workers' furthest step;
        `where()` says where each worker stands. True while stalled."""
        if last_commit is None:
            return False  # no step in this world yet: its first steps may take long (a rebuild, a compile)
        if self._seen is None or last_commit > self._seen[0]:
            if self._seen is not None and step > self._seen[1]:
                gap = (last_commit - self._seen[0]) / (step - self._seen[1])
                self.step_s = gap if self.step_s is None else 0.8 * self.step_s + 0.2 * gap
            self._seen = (last_commit, step)
            if self.stalled_since is not None:
                self.log(f"training goes on: a step committed in {world} after "
                         f"{last_commit - self.stalled_since:.0f} s without one")
                self.stalled_since = None
            return False
        quiet = self.clock() - last_commit
        limit = max(STALL_MIN_S, STALL_STEPS * (self.step_s or 0.0))
        if quiet < limit or self.stalled_since is not None:
            return self.stalled_since is not None
        self.stalled_since = last_commit
        typical = f"a step took {self.step_s:.2f} s" if self.step_s else "no step time known yet"
        self.log(f"training stalled? no step committed in {world} for {quiet:.0f} s ({typical}), and no worker "
                 f"ended and no node is gone; an evaluation or a save inside the script looks the same. Where "
                 f"the workers stand: {where()}")
        return True
