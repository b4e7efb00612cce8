"""Shared plumbing for the Store: engine, sessions-as-transactions, clock, time conversion."""
from __future__ import annotations

import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Callable, Iterator, TypeVar

from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from db.engine import open_engine
from db.errors import DatabaseError
from db.schema import upgrade
from db.urls import normalize_url

Clock = Callable[[], datetime]
T = TypeVar("T")


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def to_db(value: datetime) -> datetime:
    """Aware (or naive-as-UTC) -> naive UTC, the only form stored."""
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return value


def from_db(value: datetime | None) -> datetime | None:
    """Naive UTC from the database -> aware UTC for callers."""
    return value.replace(tzinfo=timezone.utc) if value is not None else None


def _retry_lock_race(first_transactions: Callable[[], T], tries: int = 4) -> T:
    """first_transactions(), again after a pause when SQLite lost its WAL-index race (SQLITE_PROTOCOL,
    'locking protocol'): SQLite's docs say the loser of that race retries, and SQLite itself gives up after
    some seconds of losing, which a loaded machine opening a fresh file saw once (CI); the schema's
    transactions are safe to run again (they read the version under the lock)."""
    for attempt in range(1, tries):
        try:
            return first_transactions()
        except OperationalError as exc:
            if getattr(exc.orig, "sqlite_errorname", None) != "SQLITE_PROTOCOL":
                raise
        time.sleep(0.2 * attempt)
    return first_transactions()


class StoreBase:
    """Opens the database, upgrades its schema, and hands out one transaction per call."""

    def __init__(self, url: str, *, create: bool = True, clock: Clock | None = None, readonly: bool = False,
                 upgrade_schema: bool = True, pool_size: int | None = None) -> None:
        """create: make the file and schema when missing; readonly: open SQLite read-only and refuse
        anything but a current elastic schema (nothing is ever written, not even WAL mode);
        upgrade_schema=False: refuse an older schema instead of upgrading it (see `elastic db upgrade`);
        pool_size: pooled connections, one per server thread."""
        self.url = normalize_url(url)
        self.readonly = readonly
        create = create and not readonly
        self._engine, self.display_url = open_engine(self.url, create=create, readonly=readonly,
                                                     pool_size=pool_size)
        try:
            self.schema_found, self.schema_version = _retry_lock_race(lambda: upgrade(
                self._engine, self.display_url, create=create, migrate=upgrade_schema and not readonly))
        except SQLAlchemyError as exc:
            self._engine.dispose()
            raise DatabaseError(f"cannot use {self.display_url}: {getattr(exc, 'orig', exc)}") from None
        except DatabaseError:
            self._engine.dispose()
            raise
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._clock: Clock = clock or utc_now

    def now(self) -> datetime:
        """Naive UTC 'now' from the injectable clock (tests pin time with it)."""
        return to_db(self._clock())

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        """One transaction: commit on success, roll back on any error."""
        with self._sessions() as session, session.begin():
            yield session

    def close(self) -> None:
        """Release pooled connections (tests and short CLI runs call this)."""
        self._engine.dispose()

    def __enter__(self) -> "StoreBase":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
