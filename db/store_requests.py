"""Admin requests (mixed into `db.Store`): the dashboard and the CLI queue them, launchers take and
answer them, and several of each may write one shared database at once.

Why the locking: on PostgreSQL many launchers, the dashboard's request threads and CLI commands
run concurrently. `queue_request` checks and inserts under a lock on the job's row, so two identical
requests queued at the same moment cannot both pass the duplicate check; `take_request` claims the
oldest untaken request with SELECT ... FOR UPDATE SKIP LOCKED, so two takers never get the same one
and neither waits for the other; `complete_request` answers under the request's row lock and only
once. SQLite has no row locks: there `_write_lock` starts the transaction with BEGIN IMMEDIATE (the
database's one write lock), so the reads that follow see the latest state and nothing interleaves.
"""
from __future__ import annotations

import os
import socket
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, Callable, Iterator, Mapping

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from db.base import from_db
from db.engine import sqlite_write_lock
from db.errors import NotFoundError
from db.models import AdminRequestRow, JobRow, RankMapRow
from db.records import AdminRequest
from db.requests import validate_request
from db.rows import job_record
from db.vocab import MAX_ID, MAX_NAME, REQUEST_ACTIONS, check, clip


def _request(r: AdminRequestRow) -> AdminRequest:
    return AdminRequest(id=r.id, job_id=r.job_id, action=r.action, params=dict(r.params or {}),
                        requested_by=r.requested_by, status=r.status, message=r.message,
                        created_at=from_db(r.created_at), completed_at=from_db(r.completed_at),  # type: ignore[arg-type]
                        taken_at=from_db(r.taken_at), taken_by=r.taken_by)


def _write_lock(s: Session) -> None:
    """On SQLite, hold the write lock before reading (db.engine.sqlite_write_lock); PostgreSQL locks
    rows instead (FOR UPDATE in the queries that follow). The transaction's first statement."""
    sqlite_write_lock(s.connection())


def _locked(s: Session, model: Any, key: int, what: str) -> Any:
    """Row `key` of `model`, locked until the transaction ends (FOR UPDATE; on SQLite the write lock),
    or NotFoundError naming `what`. The transaction's first statement."""
    _write_lock(s)
    row = s.scalars(select(model).where(model.id == key).with_for_update()).first() if 0 < key <= MAX_ID else None
    if row is None:
        raise NotFoundError(f"no {what} with id {key}")
    return row


def _pending(s: Session, job_id: int) -> list[AdminRequestRow]:
    return list(s.scalars(select(AdminRequestRow).where(AdminRequestRow.job_id == job_id,
                                                        AdminRequestRow.status == "pending")
                          .order_by(AdminRequestRow.id)))


def _held(s: Session, job_id: int) -> list[str]:
    """Nodes the job's current rank map uses, in first-use order (db.requests.held_nodes, in `s`)."""
    row = s.scalars(select(RankMapRow).where(RankMapRow.job_id == job_id).order_by(RankMapRow.epoch.desc())
                    .limit(1).options(selectinload(RankMapRow.entries))).first()
    return list(dict.fromkeys(e.node for e in row.entries)) if row else []


def launcher_id() -> str:
    """host:pid, recorded on the requests a launcher takes."""
    return clip(f"{socket.gethostname()}:{os.getpid()}", MAX_NAME) or "?"


class RequestsMixin:
    """Queue, take and answer admin requests; relies on StoreBase's _tx and now."""

    _tx: Callable[[], AbstractContextManager[Session]]
    now: Callable[[], datetime]

    def add_request(self, job_id: int, action: str, params: Mapping[str, Any], requested_by: str) -> int:
        """Queue an admin action as given (no validation: see queue_request); NotFoundError for an
        unknown job. The job's row is locked, so it orders with queue_request's checks."""
        check("action", action, REQUEST_ACTIONS)
        with self._tx() as s:
            _locked(s, JobRow, job_id, "job")
            row = AdminRequestRow(job_id=job_id, action=action, params=dict(params), requested_by=requested_by,
                                  status="pending", created_at=self.now())
            s.add(row)
            s.flush()
            return row.id

    def queue_request(self, job_id: int, action: str, raw: Mapping[str, Any],
                      requested_by: str) -> tuple[int, dict[str, Any]]:
        """Validate (db.requests.validate_request, against the nodes held and the requests pending now)
        and queue in one transaction under the job's row lock: (request id, normalised params).
        ValueError says why it cannot be queued, NotFoundError that the job does not exist."""
        with self._tx() as s:
            row = _locked(s, JobRow, job_id, "job")
            pending = [_request(r) for r in _pending(s, job_id)]
            params = validate_request(job_record(row), _held(s, job_id), pending, action, raw)
            req = AdminRequestRow(job_id=job_id, action=action, params=params, requested_by=requested_by,
                                  status="pending", created_at=self.now())
            s.add(req)
            s.flush()
            return req.id, params

    def take_request(self, job_id: int, taker: str | None = None) -> AdminRequest | None:
        """Claim the job's oldest pending request no one has taken (marked taken_at/taken_by, still
        pending until complete_request), or None. Rows another transaction is claiming are skipped
        (SKIP LOCKED), so concurrent takers never get the same request."""
        with self._tx() as s:
            _write_lock(s)
            row = s.scalars(select(AdminRequestRow)
                            .where(AdminRequestRow.job_id == job_id, AdminRequestRow.status == "pending",
                                   AdminRequestRow.taken_at.is_(None))
                            .order_by(AdminRequestRow.id).limit(1)
                            .with_for_update(skip_locked=True)).first()
            if row is None:
                return None
            row.taken_at, row.taken_by = self.now(), clip(taker or launcher_id(), MAX_NAME)
            return _request(row)

    def take_requests(self, job_id: int, taker: str | None = None) -> Iterator[AdminRequest]:
        """The launcher's loop over its requests: takes one at a time, so stopping the loop (the job
        was suspended) leaves the rest untaken for whoever continues the job."""
        while (req := self.take_request(job_id, taker)) is not None:
            yield req

    def pending_requests(self, job_id: int) -> list[AdminRequest]:
        """Requests not answered yet (taken or not), oldest first."""
        with self._tx() as s:
            return [_request(r) for r in _pending(s, job_id)]

    def list_requests(self, job_id: int | None = None, limit: int = 20) -> list[AdminRequest]:
        """Recent requests of any status, newest first."""
        with self._tx() as s:
            q = select(AdminRequestRow).order_by(AdminRequestRow.id.desc()).limit(limit)
            if job_id is not None:
                q = q.where(AdminRequestRow.job_id == job_id)
            return [_request(r) for r in s.scalars(q)]

    def get_request(self, rid: int) -> AdminRequest | None:
        if not 0 < rid <= MAX_ID:
            return None
        with self._tx() as s:
            row = s.get(AdminRequestRow, rid)
            return _request(row) if row else None

    def complete_request(self, rid: int, status: str, message: str | None = None) -> bool:
        """The launcher's answer to a request: done or failed, with a message for humans. Only the
        first answer counts: False (and nothing changed) when the request was already answered."""
        check("request status", status, ("done", "failed"))
        with self._tx() as s:
            row = _locked(s, AdminRequestRow, rid, "request")
            if row.status != "pending":
                return False
            row.status, row.message, row.completed_at = status, message, self.now()
            return True
