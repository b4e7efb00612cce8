"""Allowed values of every enumerated column, shared by the store, the CLI and the dashboard.

Kept as plain tuples (no SQLAlchemy) so argument parsers can offer them as choices.
"""
from __future__ import annotations

JOB_STATES = ("running", "suspended", "finished", "failed", "stopped")
JOB_MODES = ("live", "restart")  # live: state moves between running workers; restart: torchrun-style restarts
MIGRATION_KINDS = ("live", "restart")
NODE_STATES = ("active", "idle", "released", "failed")
DEVICE_STATES = ("used", "idle", "failed")
MIGRATION_TRIGGERS = ("resize", "preempt", "signal", "failure", "dashboard", "demo")
MIGRATION_STATUSES = ("planned", "running", "succeeded", "failed")
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
