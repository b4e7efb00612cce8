"""Request-scoped helpers shared by views and actions."""
from __future__ import annotations

from typing import TYPE_CHECKING

from flask import abort, current_app, g, request

from service.authz import may_see, owner_filter
from service.identity import Caller

if TYPE_CHECKING:
    from db.records import Job
    from db.store import Store


def store() -> "Store":
    """The app's Store (one per app; it is thread-safe: one session per call)."""
    return current_app.extensions["elastic_store"]


def is_htmx() -> bool:
    """True for requests made by htmx, which get a partial instead of a full page."""
    return request.headers.get("HX-Request") == "true"


def viewer() -> Caller:
    """The logged-in user as service.authz sees them: admins are the dashboard's operators."""
    return Caller(g.user.name, -1, operator=g.user.is_admin)


def _private() -> bool:
    return bool(current_app.config.get("PRIVATE_JOBS"))


def owner_shown() -> str | None:
    """The owner listings are narrowed to: the user's own jobs where the site keeps jobs private."""
    return owner_filter(viewer(), _private())


def visible(job: "Job | None", what: str) -> "Job":
    """The job, or 404 when there is none or the site keeps it private from this user (as if absent)."""
    if job is None or not may_see(viewer(), job, _private()):
        abort(404, description=f"no {what}")
    return job
