"""Whether anybody still drives a running job: its launcher heartbeats into the database (every few
seconds, Store.heartbeat); a `running` job whose heartbeat is older than LOST_AFTER_S is `lost` -- its
launcher died (kill -9, its node crashed) and nothing will record its end. Shown, not stored: the row
stays `running` until a launcher takes the job over (`elastic-launch --resume`) or ends it."""
from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

HEARTBEAT_S = 5.0  # how often a launcher says it is alive
#: no heartbeat for this long: lost (a few missed heartbeats; ELASTIC_LOST_AFTER_S overrides it)
LOST_AFTER_S = 60.0


def lost_after() -> timedelta:
    return timedelta(seconds=float(os.environ.get("ELASTIC_LOST_AFTER_S", LOST_AFTER_S)))


def lost_since(job, now: datetime | None = None) -> datetime | None:
    """When a running job's launcher last said it was alive, if that is too long ago; else None (alive,
    not running, or recorded before heartbeats)."""
    if job.state != "running" or job.heartbeat_at is None:
        return None
    now = now or datetime.now(timezone.utc)
    return job.heartbeat_at if now - job.heartbeat_at > lost_after() else None


def shown_state(job, now: datetime | None = None) -> str:
    """The state a person is shown: `lost` for a running job nobody drives, else the recorded one."""
    return "lost" if lost_since(job, now) is not None else job.state


def resume_hint(job) -> str:
    """What to run to take a lost job over (the same job goes on from its newest complete checkpoint)."""
    where = f" (newest complete checkpoint: {job.checkpoint_path}, step {job.checkpoint_step})" \
        if job.checkpoint_path else " (no complete checkpoint recorded: it starts from the beginning)"
    return f"resume it with: elastic-launch --resume --job-name {job.name} ... (its launch flags){where}"
