"""When this worker's next event applies: the step boundary every rank of the training world takes.

Why here and not on the store at every step: each step's vote (launcher.runtime.vote) says whether the next
event is posted, so every rank learns of it at the same vote and takes the same boundary without a store
round trip of its own: the event applies after the next step (one step to prepare while training goes on),
an urgent one (a recovery) at once. A step that voted on no update (none yet in this world, or a script
that skipped optimizer.step()) looks on the store and agrees on the boundary there (Control.agree_at:
ranks may then be a step apart).
"""
from __future__ import annotations

from collections.abc import Callable

from launcher.runtime.vote import StepVote
from launcher.wire.control import Control


class EventBoundary:
    """The next event and the step after which it applies, once this worker knows of it."""

    def __init__(self, ctl: Control, vote: StepVote, prepare: Callable[[dict], None],
                 log: Callable[[str], None]) -> None:
        self.ctl, self.vote, self.prepare, self.log = ctl, vote, prepare, log
        self.at: int | None = None  # the step after which `event` applies
        self.event: dict | None = None
        self.told = False  # the last vote said the next event is posted

    def clear(self) -> None:
        self.at = self.event = None

    def due(self, epoch: int, step: int, voted: bool, rank: int, device: int) -> dict | None:
        """Event `epoch` once known (its boundary in `at`), else None. voted: this step's update was voted
        on (and committed), so `told` is what rank 0 saw."""
        if self.at is not None:
            return self.event
        if voted and not self.told:
            return None
        ev = self.ctl.event(epoch)
        if ev is None:
            return None
        self.ctl.mark("event seen")
        self.vote.heartbeat(device, step, None, force=True)  # where the workers stood, should it time out
        if ev.get("urgent"):
            self.at = step
        elif voted:
            self.at = step + 1
            if rank == 0:  # for the launcher: the boundary the workers took
                self.ctl.agree_at(epoch, step - 1)
        else:
            self.at = self.ctl.agree_at(epoch, step)
        self.event = ev
        self.log(f"event {epoch} ({ev.get('kind')}) seen after step {step}: applies after step {self.at}")
        if not ev.get("urgent"):
            self.prepare(ev)  # while the old layout still trains, outside the pause
        return ev
