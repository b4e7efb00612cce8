"""The audit log and dashboard users (mixed into `db.Store`); admin requests are in db.store_requests."""
from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, Callable

from dataclasses import dataclass
from functools import lru_cache

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session
from werkzeug.security import check_password_hash, generate_password_hash

from db.base import from_db, to_db
from db.models import AuditRowORM, UserRow
from db.records import AuditRow, User
from db.vocab import (
    MAX_ACTION,
    MAX_ADDRESS,
    MAX_NAME,
    MAX_PASSWORD,
    MAX_RESULT,
    ROLES,
    check,
    clip,
)


@lru_cache(maxsize=1)
def _dummy_hash() -> str:
    """A hash made like real ones, checked for unknown names so they cost what known names cost."""
    return generate_password_hash("no such user: constant-time login")


@dataclass(frozen=True)
class AuditFilters:
    """Typed filters for the audit page (all optional; text filters match exactly, `at` bounds inclusive)."""

    who: str | None = None
    action: str | None = None
    target: str | None = None
    address: str | None = None
    since: datetime | None = None
    until: datetime | None = None


def _audit(r: AuditRowORM) -> AuditRow:
    return AuditRow(r.id, r.who, r.action, r.target, r.result, from_db(r.at), r.address)  # type: ignore[arg-type]


class AdminMixin:
    """Methods for audit and users; relies on StoreBase's _tx and now."""

    _tx: Callable[[], AbstractContextManager[Session]]
    now: Callable[[], datetime]

    # ---------------------------------------------------------------- audit
    def audit(self, who: str, action: str, target: str, result: str, address: str | None = None) -> int:
        """Append an audit row (who did what to which target, how it went, from which address).

        Every field is clipped to its bound (db.vocab.MAX_*), since callers pass what strangers typed."""
        with self._tx() as s:
            row = AuditRowORM(who=clip(who, MAX_NAME), action=clip(action, MAX_ACTION),
                              target=clip(target, MAX_NAME), result=clip(result, MAX_RESULT),
                              address=clip(address, MAX_ADDRESS), at=self.now())
            s.add(row)
            s.flush()
            return row.id

    @staticmethod
    def _audit_query(f: AuditFilters) -> Select[Any]:
        q = select(AuditRowORM)
        for column, value in ((AuditRowORM.who, f.who), (AuditRowORM.action, f.action),
                              (AuditRowORM.target, f.target), (AuditRowORM.address, f.address)):
            if value is not None:
                q = q.where(column == value)
        if f.since is not None:
            q = q.where(AuditRowORM.at >= to_db(f.since))
        if f.until is not None:
            q = q.where(AuditRowORM.at <= to_db(f.until))
        return q

    def audit_log(self, limit: int = 50, target: str | None = None, *, filters: AuditFilters | None = None,
                  offset: int = 0) -> list[AuditRow]:
        """Most recent audit rows first, optionally filtered (target= is shorthand for one filter)."""
        f = filters or AuditFilters(target=target)
        with self._tx() as s:
            q = self._audit_query(f).order_by(AuditRowORM.id.desc()).limit(limit).offset(offset)
            return [_audit(r) for r in s.scalars(q)]

    def audit_count(self, filters: AuditFilters | None = None) -> int:
        """How many rows audit_log would page through with these filters."""
        q = self._audit_query(filters or AuditFilters())
        with self._tx() as s:
            return int(s.scalar(select(func.count()).select_from(q.subquery())) or 0)

    # ---------------------------------------------------------------- users
    def add_user(self, name: str, password: str, role: str = "viewer", *, replace: bool = False) -> None:
        """Create a dashboard user (password stored as a werkzeug hash); replace=True resets it and
        revokes every session the user had (a stolen cookie dies with the old password)."""
        check("role", role, ROLES)
        if not name.strip() or not password:
            raise ValueError("user name and password must not be empty")
        if len(name) > MAX_NAME or not name.isprintable():
            raise ValueError(f"user name must be printable and at most {MAX_NAME} characters")
        if len(password) > MAX_PASSWORD:
            raise ValueError(f"password too long (at most {MAX_PASSWORD} characters)")
        with self._tx() as s:
            row = s.scalars(select(UserRow).where(UserRow.name == name)).first()
            if row is not None and not replace:
                raise ValueError(f"user {name!r} already exists")
            if row is None:
                row = UserRow(name=name, created_at=self.now(), session_version=0)
                s.add(row)
            else:
                row.session_version = (row.session_version or 0) + 1
            row.password_hash, row.role = generate_password_hash(password), role

    def site_user(self, name: str, role: str) -> User:
        """The dashboard's row of a user the site's login proved (PAM): created on first login with no usable
        password (no local login with it), its role set from the site (the operators group) at every login."""
        check("role", role, ROLES)
        if not name.strip() or len(name) > MAX_NAME or not name.isprintable():
            raise ValueError(f"user name must be printable and at most {MAX_NAME} characters")
        with self._tx() as s:
            row = s.scalars(select(UserRow).where(UserRow.name == name)).first()
            if row is None:
                row = UserRow(name=name, created_at=self.now(), session_version=0, password_hash="!site-login")
                s.add(row)
            row.role = role
            s.flush()
            return User(row.name, row.role, row.session_version or 0)

    def revoke_sessions(self, name: str) -> None:
        """Invalidate every session cookie issued to this user so far (logout does this)."""
        with self._tx() as s:
            row = s.scalars(select(UserRow).where(UserRow.name == name)).first()
            if row is not None:
                row.session_version = (row.session_version or 0) + 1

    def get_user(self, name: str) -> User | None:
        if len(name) > MAX_NAME:
            return None
        with self._tx() as s:
            row = s.scalars(select(UserRow).where(UserRow.name == name)).first()
            return User(row.name, row.role, row.session_version) if row else None

    def list_users(self) -> list[User]:
        with self._tx() as s:
            return [User(r.name, r.role, r.session_version) for r in s.scalars(select(UserRow).order_by(UserRow.name))]

    def verify_user(self, name: str, password: str) -> User | None:
        """The user if the password matches, else None: same answer and the same hashing work for
        unknown names, so timing does not tell which names exist."""
        row = None
        if len(name) <= MAX_NAME:
            with self._tx() as s:
                row = s.scalars(select(UserRow).where(UserRow.name == name)).first()
        stored = row.password_hash if row is not None else _dummy_hash()
        ok = check_password_hash(stored, password[:MAX_PASSWORD]) and len(password) <= MAX_PASSWORD
        if row is None or not ok:
            return None
        return User(row.name, row.role, row.session_version)
