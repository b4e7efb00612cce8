"""A job's resize policy in the database (mixed into `db.Store`): which one it runs, switched by an admin from
the dashboard or set by `elastic-launch --policy`, and the policy's last look at the cluster.

Why here: the launcher and the dashboard meet only in the database. The launcher reads the policy on every
look (every few seconds), so an admin's switch takes effect without a request queue or a migration, and writes
what it saw (idle nodes, the pending jobs it watches, what it decided), which /cluster shows."""
from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, Callable, Mapping

from sqlalchemy.orm import Session

from db.base import to_db
from db.models import JobRow
from db.vocab import POLICIES, check


class PolicyMixin:
    """Relies on StoreBase's _tx and now."""

    _tx: Callable[[], AbstractContextManager[Session]]
    now: Callable[[], datetime]
    _job_row: Callable[[Session, int], JobRow]

    def set_policy(self, job_id: int, policy: str) -> str:
        """Switch job `job_id` to `policy` (POLICIES); returns the one it had."""
        check("policy", policy, POLICIES)
        with self._tx() as s:
            row = self._job_row(s, job_id)
            before, row.policy, row.updated_at = row.policy or "manual", policy, self.now()
            return before

    def record_policy_watch(self, job_id: int, watch: Mapping[str, Any]) -> None:
        """What the policy saw and decided at its last look (plain JSON values), stamped with the time."""
        with self._tx() as s:
            self._job_row(s, job_id).policy_watch = {**watch, "at": to_db(self.now()).isoformat()}
