"""What the runtime itself costs a training step, measured inside each worker, in steady state.

Why: live mode puts the runtime into every step (the step boundary -- heartbeat, the registered objects'
snapshot, the safety checkpoint's poll -- and the commit vote); a script in restart mode has none of it.
Over the steps in which no event applied, each worker keeps every step's wall time, its seconds in
`job.next_step()` (the boundary: its own work and store round trips) and in the vote. A vote also waits for
the slowest rank to finish its step, which is not the runtime's cost (in restart mode the same rank waits at
its next collective instead): the rank that votes last waits for nobody, so the smallest vote time of a
step across ranks is what the vote costs it. $ELASTIC_RUNTIME_STATS names a folder: each worker writes
its figures there as it leaves (`elastic bench-control --steady` runs jobs and reads them).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

ENV_RUNTIME_STATS = "ELASTIC_RUNTIME_STATS"


class StepCost:
    """One worker's running sums (see the module docstring)."""

    def __init__(self, folder: str | None = None) -> None:
        self.folder = folder if folder is not None else os.environ.get(ENV_RUNTIME_STATS)
        self.wall: list[float] = []  # per steady step: seconds from its start to the next one's
        self.boundary_s: list[float] = []  # ... in the next_step() that ended it
        self.vote_s: list[float] = []  # ... voting
        self._began: float | None = None  # when the step in flight began (the last boundary's end)
        self._voting = 0.0  # seconds of the step in flight spent voting

    def voted(self, seconds: float) -> None:
        self._voting += seconds

    def boundary(self, t0: float, t1: float, steady: bool) -> None:
        """next_step() ran from t0 to t1 (perf_counter); steady: no event applied in it."""
        if steady and self._began is not None:
            self.wall.append(t1 - self._began)
            self.boundary_s.append(t1 - t0)
            self.vote_s.append(self._voting)
        self._voting, self._began = 0.0, t1 if steady else None

    def write(self, device: int) -> None:
        if self.folder:
            Path(self.folder).mkdir(parents=True, exist_ok=True)
            (Path(self.folder) / f"dev{device}.json").write_text(json.dumps(
                {"device": device, "wall_s": self.wall, "boundary_s": self.boundary_s, "vote_s": self.vote_s}))
