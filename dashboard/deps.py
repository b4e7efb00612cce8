"""Request-scoped helpers shared by views and actions."""
from __future__ import annotations

from typing import TYPE_CHECKING

from flask import current_app, request

if TYPE_CHECKING:
    from db.store import Store


def store() -> "Store":
    """The app's Store (one per app; it is thread-safe: one session per call)."""
    return current_app.extensions["elastic_store"]


def is_htmx() -> bool:
    """True for requests made by htmx, which get a partial instead of a full page."""
    return request.headers.get("HX-Request") == "true"
