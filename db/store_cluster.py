"""What the cluster view and the live stream read and write (mixed into `db.Store`): each job's
launch spec, the steps workers commit (loss curve, step rate), samples of cluster-wide
fragmentation, and cheap change marks that tell the event stream something moved."""
from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, Callable, Mapping

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from db.base import from_db, to_db
from db.errors import NotFoundError
from db.models import (
    AdminRequestRow,
    ClusterSampleRow,
    JobRow,
    JobStepRow,
    MigrationPhaseRow,
    MigrationRow,
    RankMapRow,
)
from db.records import ClusterSample, Fragmentation, StepRecord


class ClusterMixin:
    """Methods for the cluster view; relies on StoreBase's _tx and now."""

    _tx: Callable[[], AbstractContextManager[Session]]
    now: Callable[[], datetime]

    # ---------------------------------------------------------- launch spec
    def set_launch_spec(self, job_id: int, spec: Mapping[str, Any]) -> None:
        """Remember how the job was launched: {"model": {...}, "min_nodes", "max_nodes",
        "layouts": {"<devices>": "ppXtpYdpZ"}} — what a dry run of a preempt needs."""
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is None:
                raise NotFoundError(f"no job with id {job_id}")
            row.launch_spec = dict(spec)

    def launch_spec(self, job_id: int) -> dict[str, Any] | None:
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is None:
                raise NotFoundError(f"no job with id {job_id}")
            return dict(row.launch_spec) if row.launch_spec else None

    # ---------------------------------------------------------------- steps
    def record_step(self, job_id: int, step: int, loss: float | None, layout: str) -> None:
        """A committed step (the worker that computes the loss reports it once per step)."""
        self.record_steps(job_id, [(step, loss, layout)])

    def record_steps(self, job_id: int, reports) -> None:
        """Committed steps, (step, loss, layout) each, in one transaction."""
        with self._tx() as s:
            at = self.now()
            s.add_all([JobStepRow(job_id=job_id, step=int(step), loss=None if loss is None else float(loss),
                                  layout=layout, at=at) for step, loss, layout in reports])

    def steps(self, job_id: int, limit: int = 5000) -> list[StepRecord]:
        """The job's latest `limit` reported steps, oldest first."""
        with self._tx() as s:
            rows = list(s.scalars(select(JobStepRow).where(JobStepRow.job_id == job_id)
                                  .order_by(JobStepRow.id.desc()).limit(limit)))
            return [StepRecord(r.job_id, r.step, r.loss, r.layout, from_db(r.at))  # type: ignore[arg-type]
                    for r in reversed(rows)]

    # ------------------------------------------------------ cluster samples
    def add_cluster_sample(self, sample: ClusterSample, min_interval_s: float = 0.0) -> bool:
        """Store a fragmentation sample unless the last one is younger than min_interval_s."""
        with self._tx() as s:
            last = s.scalar(select(func.max(ClusterSampleRow.at)))
            if last is not None and to_db(sample.at) - last < timedelta(seconds=min_interval_s):
                return False
            f = sample.figures
            s.add(ClusterSampleRow(at=to_db(sample.at), source=sample.source, gpus_total=f.gpus_total,
                                   gpus_free=f.gpus_free, stranded=f.stranded, free_nodes=f.free_nodes,
                                   largest_free_block=f.largest_free_block, frag_index=f.index))
            return True

    def cluster_samples(self, since: datetime | None = None, limit: int = 500) -> list[ClusterSample]:
        """Samples oldest first (the newest `limit` of them, from `since` on)."""
        q = select(ClusterSampleRow).order_by(ClusterSampleRow.at.desc(), ClusterSampleRow.id.desc()).limit(limit)
        if since is not None:
            q = q.where(ClusterSampleRow.at >= to_db(since))
        with self._tx() as s:
            rows = list(s.scalars(q))
            return [ClusterSample(from_db(r.at), r.source, Fragmentation(  # type: ignore[arg-type]
                r.gpus_total, r.gpus_free, r.stranded, r.free_nodes, r.largest_free_block, r.frag_index))
                for r in reversed(rows)]

    # --------------------------------------------------------- change marks
    def change_marks(self) -> dict[str, tuple[Any, ...]]:
        """Small tuples that change whenever placements, migrations or requests change: the event
        stream compares them between polls instead of diffing whole pages (one short query each)."""
        with self._tx() as s:
            jobs = s.execute(select(func.count(JobRow.id), func.max(JobRow.updated_at))).one()
            maps = s.execute(select(func.max(RankMapRow.id))).one()
            migs = s.execute(select(func.max(MigrationRow.id), func.count(MigrationRow.finished_at),
                                    func.max(MigrationPhaseRow.id)).select_from(MigrationRow)
                             .outerjoin(MigrationPhaseRow, MigrationPhaseRow.migration_id == MigrationRow.id)).one()
            reqs = s.execute(select(func.max(AdminRequestRow.id), func.count(AdminRequestRow.completed_at))).one()
            return {"placement": (*jobs, *maps), "migration": tuple(migs), "request": tuple(reqs)}
