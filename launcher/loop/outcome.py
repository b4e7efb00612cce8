"""What a trigger led to: one Outcome per trigger, and the two ways a migration ends without one.

Every mode (launcher.loop.live, launcher.loop.restart) reports an Outcome; launcher.loop.recorder writes
it down. A migration that does not commit leaves the job on its old layout (MigrationFailed), or is
declined because training ended first (TrainingEnded).
"""
from __future__ import annotations

from dataclasses import dataclass, field


class MigrationFailed(RuntimeError):
    """A migration (or start) could not complete; the message says why."""

    status = "failed"  # how the migration is recorded


class TrainingEnded(MigrationFailed):
    """The workers finished their last step (exit code 0) before the migration could apply: nothing is
    left to move, so the migration is recorded as declined, not failed, and the old layout is not
    resumed (its workers have exited)."""

    status = "declined"


@dataclass
class Outcome:
    """What one trigger led to (for logs, requests and the demo's table)."""

    trigger: str
    ok: bool
    message: str
    from_layout: str = ""
    to_layout: str = ""
    phases: dict = field(default_factory=dict)
    bytes_moved: int = 0
    bytes_checkpoint: int = 0
    bit_exact: bool | None = None
    migration_id: int | None = None
    nodes_before: int = 0
    nodes_after: int = 0
    at_step: int | None = None
    pause_s: float | None = None  # set once the new layout committed its first step (launcher.loop.pauses)
    marks: dict = field(default_factory=dict)  # device -> {mark: wall time} its worker reported (launcher.loop.timeline)
    worlds: tuple[str, str] | None = None  # (old, new) training world: the pause runs from one to the other
