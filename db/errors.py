"""The one exception type callers need to catch from the database layer."""
from __future__ import annotations


class DatabaseError(Exception):
    """The database could not be opened or used.

    The message always says which URL, why, and what to do, because it is shown to
    operators verbatim by the CLI and the dashboard.
    """


class NotFoundError(LookupError):
    """A job, migration, request or node that the caller named does not exist."""
