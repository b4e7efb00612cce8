"""Opening the elastic database for a command: the URL chosen one way (--db, $ELASTIC_DB_URL, default), errors as UsageErrors."""
from __future__ import annotations

from typing import TYPE_CHECKING

from db.urls import default_url, normalize_url
from launcher.errors import UsageError

if TYPE_CHECKING:
    from db.store import Store


def db_url(url: str | None) -> str:
    """The database URL a command uses for `--db url` (None: $ELASTIC_DB_URL, else the default)."""
    return normalize_url(url or default_url())


def open_store(url: str | None, *, create: bool = False, readonly: bool = False) -> "Store":
    """Open the store, turning a DatabaseError into a UsageError (exit 2, nothing created).

    An http(s):// URL is the cluster's shared service (`elastic serve`): the same methods, called over HTTP
    with this process's munge credential (service.client). Otherwise the database itself: only a creating
    opener (the launcher) upgrades an older schema; the others refuse it and name `elastic db upgrade`, and
    readonly=True (history) never writes a byte."""
    from db import DatabaseError, Store
    from service.client import ServiceStore, is_service_url

    chosen = url or default_url()
    if is_service_url(chosen):
        return ServiceStore(chosen)  # type: ignore[return-value]
    try:
        return Store(db_url(url), create=create, readonly=readonly, upgrade_schema=create)
    except DatabaseError as exc:
        raise UsageError(str(exc)) from None
