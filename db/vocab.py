"""Allowed values of every enumerated column, shared by the store, the CLI and the dashboard.

Kept as plain tuples (no SQLAlchemy) so argument parsers can offer them as choices.
"""
from __future__ import annotations

JOB_STATES = ("running", "suspended", "finished", "failed", "stopped")
POLICIES = ("manual", "opportunistic")  # who resizes a job: people (and signals) only, or also the launcher itself
JOB_MODES = ("live", "restart")  # live: state moves between running workers; restart: torchrun-style restarts
MIGRATION_KINDS = ("live", "restart")
NODE_STATES = ("active", "idle", "released", "failed")
DEVICE_STATES = ("used", "idle", "failed")
MIGRATION_TRIGGERS = ("resize", "preempt", "signal", "failure", "dashboard", "demo", "requeue", "policy")
MIGRATION_STATUSES = ("planned", "running", "succeeded", "failed", "declined")  # declined: nothing left to move
PHASES = ("plan", "build_groups", "execute", "rebuild", "other", "stop", "start")
REQUEST_ACTIONS = ("preempt", "shrink", "grow", "suspend", "resume")
REQUEST_STATUSES = ("pending", "done", "failed")
ROLES = ("admin", "viewer")
SLA_TIERS = {"premium": 0.95, "standard": 0.7}


def check(kind: str, value: str, allowed: tuple[str, ...] | dict[str, float]) -> str:
    """Return value if allowed, else raise ValueError naming the allowed values."""
    if value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}: expected one of {', '.join(allowed)}")
    return value

# Bounds on free-text fields, so no request (or failed login) can store or echo unbounded text.
MAX_NAME = 200       # user, job and node names; audit `who` and `target`
MAX_ACTION = 64      # audit `action`
MAX_RESULT = 2000    # audit `result`
MAX_ADDRESS = 64     # audit `address` (an IPv6 literal fits)
MAX_PASSWORD = 1024  # longer passwords only cost hashing time
MAX_ID = 2**63 - 1   # database ids are signed 64-bit; anything larger names nothing


def clip(text: str | None, limit: int) -> str | None:
    """text cut to `limit` characters (the last one an ellipsis when cut); None stays None."""
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "…"
