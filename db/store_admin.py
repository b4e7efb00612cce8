"""Admin requests, the audit log and dashboard users (mixed into `db.Store`).

The dashboard and CLI only *request* actions here; the launcher polls
`pending_requests` and reports back with `complete_request`.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, Callable, Mapping

from sqlalchemy import select
from sqlalchemy.orm import Session
from werkzeug.security import check_password_hash, generate_password_hash

from db.base import from_db
from db.errors import NotFoundError
from db.models import AdminRequestRow, AuditRowORM, JobRow, UserRow
from db.records import AdminRequest, AuditRow, User
from db.vocab import REQUEST_ACTIONS, ROLES, check


def _request(r: AdminRequestRow) -> AdminRequest:
    return AdminRequest(id=r.id, job_id=r.job_id, action=r.action, params=dict(r.params or {}),
                        requested_by=r.requested_by, status=r.status, message=r.message,
                        created_at=from_db(r.created_at), completed_at=from_db(r.completed_at))  # type: ignore[arg-type]


class AdminMixin:
    """Methods for requests, audit and users; relies on StoreBase's _tx and now."""

    _tx: Callable[[], AbstractContextManager[Session]]
    now: Callable[[], datetime]

    # ------------------------------------------------------------- requests
    def add_request(self, job_id: int, action: str, params: Mapping[str, Any], requested_by: str) -> int:
        """Queue an admin action for the launcher; raises NotFoundError for an unknown job."""
        check("action", action, REQUEST_ACTIONS)
        with self._tx() as s:
            if s.get(JobRow, job_id) is None:
                raise NotFoundError(f"no job with id {job_id}")
            row = AdminRequestRow(job_id=job_id, action=action, params=dict(params), requested_by=requested_by,
                                  status="pending", created_at=self.now())
            s.add(row)
            s.flush()
            return row.id

    def pending_requests(self, job_id: int) -> list[AdminRequest]:
        """Requests the launcher has not carried out yet, oldest first."""
        with self._tx() as s:
            rows = s.scalars(select(AdminRequestRow).where(AdminRequestRow.job_id == job_id,
                                                           AdminRequestRow.status == "pending")
                             .order_by(AdminRequestRow.id))
            return [_request(r) for r in rows]

    def list_requests(self, job_id: int | None = None, limit: int = 20) -> list[AdminRequest]:
        """Recent requests of any status, newest first."""
        with self._tx() as s:
            q = select(AdminRequestRow).order_by(AdminRequestRow.id.desc()).limit(limit)
            if job_id is not None:
                q = q.where(AdminRequestRow.job_id == job_id)
            return [_request(r) for r in s.scalars(q)]

    def get_request(self, rid: int) -> AdminRequest | None:
        with self._tx() as s:
            row = s.get(AdminRequestRow, rid)
            return _request(row) if row else None

    def complete_request(self, rid: int, status: str, message: str | None = None) -> None:
        """The launcher's answer to a request: done or failed, with a message for humans."""
        check("request status", status, ("done", "failed"))
        with self._tx() as s:
            row = s.get(AdminRequestRow, rid)
            if row is None:
                raise NotFoundError(f"no request with id {rid}")
            row.status, row.message, row.completed_at = status, message, self.now()

    # ---------------------------------------------------------------- audit
    def audit(self, who: str, action: str, target: str, result: str) -> int:
        """Append an audit row (who did what to which target, and how it went)."""
        with self._tx() as s:
            row = AuditRowORM(who=who, action=action, target=target, result=result, at=self.now())
            s.add(row)
            s.flush()
            return row.id

    def audit_log(self, limit: int = 50, target: str | None = None) -> list[AuditRow]:
        """Most recent audit rows first."""
        with self._tx() as s:
            q = select(AuditRowORM).order_by(AuditRowORM.id.desc()).limit(limit)
            if target is not None:
                q = q.where(AuditRowORM.target == target)
            return [AuditRow(r.id, r.who, r.action, r.target, r.result, from_db(r.at))  # type: ignore[arg-type]
                    for r in s.scalars(q)]

    # ---------------------------------------------------------------- users
    def add_user(self, name: str, password: str, role: str = "viewer", *, replace: bool = False) -> None:
        """Create a dashboard user (password stored as a werkzeug hash); replace=True resets it."""
        check("role", role, ROLES)
        if not name.strip() or not password:
            raise ValueError("user name and password must not be empty")
        with self._tx() as s:
            row = s.scalars(select(UserRow).where(UserRow.name == name)).first()
            if row is not None and not replace:
                raise ValueError(f"user {name!r} already exists")
            if row is None:
                row = UserRow(name=name, created_at=self.now())
                s.add(row)
            row.password_hash, row.role = generate_password_hash(password), role

    def get_user(self, name: str) -> User | None:
        with self._tx() as s:
            row = s.scalars(select(UserRow).where(UserRow.name == name)).first()
            return User(row.name, row.role, row.session_version) if row else None

    def list_users(self) -> list[User]:
        with self._tx() as s:
            return [User(r.name, r.role) for r in s.scalars(select(UserRow).order_by(UserRow.name))]

    def verify_user(self, name: str, password: str) -> User | None:
        """The user if the password matches, else None (same answer for unknown names)."""
        with self._tx() as s:
            row = s.scalars(select(UserRow).where(UserRow.name == name)).first()
            if row is None or not check_password_hash(row.password_hash, password):
                return None
            return User(row.name, row.role)
