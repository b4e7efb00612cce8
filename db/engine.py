"""Open an SQLAlchemy engine for a URL and turn every failure into a DatabaseError that
says which URL, why, and what to do (operators see these messages verbatim)."""
from __future__ import annotations

import os
import sqlite3
from typing import Any
from urllib.parse import quote

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.engine.url import URL
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from db.errors import DatabaseError
from db.fs import fstype_of, is_network_fstype


def _safe(url: URL) -> str:
    """The URL with any password hidden, for messages."""
    return url.render_as_string(hide_password=True)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    """WAL lets the dashboard read while the launcher writes; FKs make cascades real;
    busy_timeout makes concurrent writers wait instead of failing at once."""
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=10000")
        cur.execute("PRAGMA synchronous=NORMAL")
    finally:
        cur.close()


def _sqlite_readonly_pragmas(dbapi_conn: Any, _record: Any) -> None:
    """Read-only connections change nothing about the file (no WAL switch); they only wait for writers."""
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA busy_timeout=10000")
        cur.execute("PRAGMA query_only=ON")
    finally:
        cur.close()


def sqlite_write_lock(conn: Connection) -> None:
    """On SQLite, start the transaction with BEGIN IMMEDIATE: it waits (busy_timeout) for the one
    write lock and holds it, so the reads that follow see the latest state and no other writer
    interleaves (pysqlite would begin only at the first INSERT/UPDATE, and not at all for DDL).
    Must be the transaction's first statement. PostgreSQL: nothing (callers lock rows instead)."""
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def refuse_network_fs(path: str, shown: str) -> None:
    """DatabaseError (one line: why, and what to use instead) when SQLite file `path` is on a
    network filesystem, where WAL and SQLite's locks do not work (see db.fs). Called before the
    file is opened, so nothing is written there."""
    fstype = fstype_of(path)
    if is_network_fstype(fstype):
        where = os.path.dirname(os.path.realpath(path))
        raise DatabaseError(
            f"refusing {shown}: {where} is on {fstype}, a network filesystem, where SQLite's WAL mode and "
            "locks do not work and writers on several hosts corrupt the database; use a PostgreSQL server "
            "(--db postgresql+psycopg://USER@HOST/elastic) or a per-job SQLite file on local disk "
            "(--db sqlite:///$TMPDIR/elastic-$SLURM_JOB_ID.db, or /tmp)"
        )


def _postgres_args(readonly: bool) -> dict[str, Any]:
    """Pings before reuse (the dashboard outlives server restarts); readonly=True makes every
    transaction read-only on the server, so `elastic history` cannot write even by mistake."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if readonly:
        kwargs["connect_args"] = {"options": "-c default_transaction_read_only=on"}
    return kwargs


def open_engine(raw_url: str, *, create: bool, readonly: bool = False,
                pool_size: int | None = None) -> tuple[Engine, str]:
    """Create the engine and check it connects; returns (engine, printable URL).

    With create=False a missing SQLite file is an error and nothing is created on disk.
    readonly=True opens a SQLite file with mode=ro (a PostgreSQL session read-only), so nothing
    can be written at all. A SQLite file on a network filesystem is refused (refuse_network_fs).
    pool_size: connections kept for concurrent requests (as many again may overflow briefly).
    """
    try:
        url = make_url(raw_url)
    except ArgumentError as exc:
        raise DatabaseError(
            f"cannot parse database URL {raw_url!r}: {exc}; use e.g. sqlite:///var/elastic.db"
        ) from None
    shown = _safe(url)
    kwargs: dict[str, Any] = {}
    is_sqlite = url.get_backend_name() == "sqlite"
    memory = is_sqlite and url.database in (None, "", ":memory:")
    if is_sqlite and not memory:
        path = url.database or ""
        refuse_network_fs(path, shown)
        if not create and not os.path.exists(path):
            raise DatabaseError(
                f"no database at {shown} (file {path!r} does not exist); check --db, or let the "
                "launcher create it by starting a job"
            )
        parent = os.path.dirname(os.path.abspath(path))
        if create and not os.path.isdir(parent):
            raise DatabaseError(
                f"cannot create database {shown}: directory {parent!r} does not exist; create it first"
            )
        kwargs["connect_args"] = {"timeout": 10, "check_same_thread": False}
        if readonly:
            target = "file:" + quote(os.path.abspath(path), safe="/") + "?mode=ro"
            kwargs = {"creator": lambda: sqlite3.connect(target, uri=True, timeout=10, check_same_thread=False)}
    elif memory:
        # One shared connection, or every session would see its own empty database.
        kwargs.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
    elif url.get_backend_name() == "postgresql":
        kwargs.update(_postgres_args(readonly))
    if pool_size and not memory:
        kwargs.update(pool_size=pool_size, max_overflow=pool_size, pool_timeout=30)
    try:
        engine = create_engine(url, **kwargs)
    except NoSuchModuleError:
        raise DatabaseError(
            f"unknown database kind in {shown}: SQLAlchemy has no dialect "
            f"{url.drivername!r}; use sqlite:///PATH or e.g. postgresql+psycopg://..."
        ) from None
    except ModuleNotFoundError as exc:
        extra = " (pip install 'elastic-launch[postgres]')" if url.get_backend_name() == "postgresql" else ""
        raise DatabaseError(
            f"cannot open {shown}: its driver module {exc.name!r} is not installed; pip install it{extra}"
        ) from None
    except (ArgumentError, SQLAlchemyError) as exc:
        raise DatabaseError(f"cannot open {shown}: {exc}") from None
    if is_sqlite:
        event.listen(engine, "connect", _sqlite_readonly_pragmas if readonly and not memory else _sqlite_pragmas)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except SQLAlchemyError as exc:
        engine.dispose()
        reason = str(getattr(exc, "orig", exc)) or type(exc).__name__
        raise DatabaseError(
            f"cannot open {shown}: {reason}; check the URL, that the server is up, and permissions"
        ) from None
    return engine, shown
