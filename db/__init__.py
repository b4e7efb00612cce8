"""Persistence for elastic jobs: the `Store` facade is the only way to touch the database.

Heavy imports (SQLAlchemy) are deferred until `Store`/`DatabaseError` are first used, so
CLI subcommands can `import db` (or `db.filters`) without paying for it at start-up.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from db.errors import DatabaseError
from db.urls import DEFAULT_URL, normalize_url

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from db.records import (
        AdminRequest,
        AuditRow,
        Job,
        Migration,
        Node,
        RankEntry,
        RankMap,
        User,
    )
    from db.store import Store

__all__ = [
    "DEFAULT_URL",
    "AdminRequest",
    "AuditRow",
    "DatabaseError",
    "Job",
    "Migration",
    "Node",
    "RankEntry",
    "RankMap",
    "Store",
    "User",
    "normalize_url",
]

_LAZY = {
    "Store": "db.store",
    "AdminRequest": "db.records",
    "AuditRow": "db.records",
    "Job": "db.records",
    "Migration": "db.records",
    "Node": "db.records",
    "RankEntry": "db.records",
    "RankMap": "db.records",
    "User": "db.records",
}


def __getattr__(name: str) -> Any:
    """Import the SQLAlchemy-backed parts on first use only (keeps `elastic --help` fast)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'db' has no attribute {name!r}")
