"""ORM row -> plain record conversions that more than one part of the Store needs."""
from __future__ import annotations

from db.base import from_db
from db.models import JobRow
from db.records import Job


def job_record(row: JobRow) -> Job:
    """The Job record of a jobs row (aware UTC times; rows from before v6 have no mode: live)."""
    return Job(
        id=row.id, name=row.name, slurm_job_id=row.slurm_job_id, state=row.state, layout=row.layout,
        gpus_per_node=row.gpus_per_node, pinned_node=row.pinned_node, max_devices=row.max_devices,
        sla_tier=row.sla_tier, created_at=from_db(row.created_at), updated_at=from_db(row.updated_at),
        checkpoint_path=row.checkpoint_path, checkpoint_step=row.checkpoint_step, min_nodes=row.min_nodes,
        mode=row.mode or "live",
        last_step=row.last_step, max_nodes=row.max_nodes,
        heartbeat_at=from_db(row.heartbeat_at) if row.heartbeat_at is not None else None,
        policy=row.policy or "manual", policy_watch=row.policy_watch, owner=row.owner, owner_uid=row.owner_uid,
    )  # type: ignore[arg-type]
