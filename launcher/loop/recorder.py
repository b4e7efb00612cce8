"""The job's history as the database keeps it: every migration written by one sequence (begin, then
failed or succeeded, then the Outcome logged and kept), whatever mode or trigger led to it.

One place, so that a restart, a live move, a restore and a refusal are recorded alike (the dashboard,
`elastic history` and the demo's table read the same fields from each).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

from db.liveness import HEARTBEAT_S
from launcher.backends import Reporter
from launcher.loop.outcome import Outcome


class Recorder:
    """Writes one job's migrations, rank maps, node states and audit lines."""

    def __init__(self, db, log: Callable[[str], None] | None = None) -> None:
        self.db = db
        self.log = log or (lambda m: print(f"[elastic-launch] {m}", file=sys.stderr, flush=True))
        self.job_id: int | None = None
        self.outcomes: list[Outcome] = []
        self.epoch_base = 0  # database epochs of a resumed job continue after its earlier ones
        self.reporter = Reporter(self.log, lambda action, text: self.audit(action, text))
        self.beat_at = float("-inf")  # monotonic time of the last heartbeat
        self.reports_seen = 0  # lines of the control plane's `losses` already in the database

    def audit(self, action: str, text: str) -> None:
        self.db.audit("elastic-launch", action, f"job:{self.job_id}", text)

    def heartbeat(self, newest_checkpoint=lambda: None) -> None:
        """Say the job's launcher is alive, every HEARTBEAT_S at most (db.liveness: a job without one is lost),
        with the newest complete safety checkpoint a takeover would resume from."""
        if self.job_id is None or time.monotonic() - self.beat_at < HEARTBEAT_S:
            return
        self.beat_at = time.monotonic()
        self.db.heartbeat(self.job_id, newest_checkpoint())

    def take_steps(self, ctl) -> list[tuple[int, float | None, str]]:
        """Every step the workers reported since the last call (step, loss, layout), now in the database."""
        new, self.reports_seen = ctl.take_losses(self.reports_seen)
        if new:
            self.db.record_steps(self.job_id, new)
        return new

    # -- one migration ------------------------------------------------------------------------------
    def begin(self, out: Outcome, summary: dict, kind: str | None = None) -> int:
        """The migration is about to happen: recorded with the fragmentation before it."""
        extra = {"kind": kind} if kind else {}
        out.migration_id = self.db.start_migration(self.job_id, out.from_layout, out.to_layout, out.trigger, summary,
                                                   self.db.fragmentation(self.job_id), **extra)
        return out.migration_id

    def failed(self, out: Outcome, message: str, status: str = "failed", phases: dict | None = None,
               at_step: int | None = None, moved: int | None = None, checkpoint: int | None = None) -> Outcome:
        """The migration did not happen (`status` failed or declined); the job stays where it was."""
        out.message = message
        self.db.finish_migration(out.migration_id, status, moved, checkpoint, None, phases or {}, error=message,
                                 at_step=at_step)
        return self.done(out)

    def succeeded(self, out: Outcome, moved: int | None = None, checkpoint: int | None = None,
                  error: str | None = None, steps_lost: int | None = None) -> None:
        """The job runs on the new layout (`error`: what went wrong after the commit, e.g. a release)."""
        extra = {"steps_lost": steps_lost} if steps_lost is not None else {}
        self.db.finish_migration(out.migration_id, "succeeded", moved, checkpoint, out.bit_exact, out.phases,
                                 error=error, fragmentation_after=self.db.fragmentation(self.job_id),
                                 at_step=out.at_step, **extra)

    def refuse(self, out: Outcome, message: str, to_layout: str = "?", summary: dict | None = None) -> Outcome:
        """A migration that failed before anything moved (no plan, no nodes to be had)."""
        out.to_layout = to_layout
        self.begin(out, summary or {})
        out.message = message
        self.db.finish_migration(out.migration_id, "failed", None, None, None, {}, error=message)
        self.log(f"{out.trigger}: {message}")
        return self.keep(out)

    def done(self, out: Outcome) -> Outcome:
        """Say the outcome, numbered as `elastic history` and the pause line number it."""
        self.log(out.message if out.migration_id is None else f"migration {out.migration_id}: {out.message}")
        return self.keep(out)

    def keep(self, out: Outcome) -> Outcome:
        """The outcome without a log line (a decline, or one logged already)."""
        self.outcomes.append(out)
        return out

    def notes(self, migration_id: int, notes: list[str]) -> None:
        if notes:
            self.db.add_migration_notes(migration_id, notes)

    # -- what the job runs on -----------------------------------------------------------------------
    def rank_map(self, epoch: int, layout: str, entries: list[dict], update_job: bool = True) -> None:
        self.db.record_rank_map(self.job_id, self.epoch_base + epoch, layout, entries)
        if update_job:
            self.db.update_job(self.job_id, layout=layout)

    def node_state(self, node: str, state: str, **shape) -> None:
        self.db.set_node_state(self.job_id, node, state, **shape)

    def job_state(self, state: str, why: str | None = None) -> None:
        extra = {"why": why} if why is not None else {}
        self.db.set_job_state(self.job_id, state, **extra)

    def job_state_is(self, *states: str) -> bool:
        return self.job_id is not None and self.db.get_job(self.job_id).state in states
