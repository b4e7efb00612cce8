"""ORM tables (current schema). Only `db.store` and `db.schema` import this module.

Times are stored as naive UTC (SQLite has no time zones); the store converts to aware UTC
at the boundary. JSON columns hold small summaries only (plans, fragmentation snapshots).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Optional

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class Base(DeclarativeBase):
    """Declarative base; `Base.metadata` is the current schema."""


class SchemaVersion(Base):
    """One row holding the schema version, so `db.schema.upgrade` knows what to run."""

    __tablename__ = "schema_version"
    id: Mapped[int] = mapped_column(primary_key=True)
    version: Mapped[int]


class JobRow(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    slurm_job_id: Mapped[Optional[str]] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), index=True)  # v4 index: running jobs first
    layout: Mapped[str] = mapped_column(String(64))
    gpus_per_node: Mapped[int]
    pinned_node: Mapped[Optional[str]] = mapped_column(String(200))
    max_devices: Mapped[int]
    sla_tier: Mapped[str] = mapped_column(String(16), default="standard")
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    checkpoint_path: Mapped[Optional[str]] = mapped_column(Text)  # v3: what a suspended job resumes from
    checkpoint_step: Mapped[Optional[int]]
    min_nodes: Mapped[int] = mapped_column(default=1, server_default="1")  # v4: requests never go below it
    mode: Mapped[str] = mapped_column(String(16), default="live")  # v6: live (runtime API) or restart (torchrun's)
    last_step: Mapped[Optional[int]]  # v6: the last finished training step the launcher saw
    launch_spec: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON)  # v7: model, node range, layout per size
    max_nodes: Mapped[Optional[int]]  # v9: --nnodes MAX (NULL: derived from max_devices / gpus_per_node)
    heartbeat_at: Mapped[Optional[datetime]]  # v10: the launcher's last sign of life (db.liveness)
    policy: Mapped[str] = mapped_column(String(16), default="manual", server_default="manual")  # v11: POLICIES
    policy_watch: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON)  # v11: the policy's last look
    owner: Mapped[Optional[str]] = mapped_column(String(64))  # v12: the Unix user whose launcher created it
    owner_uid: Mapped[Optional[int]]  # v12: that user's uid (munge's proof, when written through the service)


class NodeRow(Base):
    __tablename__ = "nodes"
    __table_args__ = (UniqueConstraint("job_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16))
    pinned: Mapped[bool] = mapped_column(default=False)
    gpus: Mapped[Optional[int]]  # v8: the node's GPU count (uneven nodes); NULL on older rows: the job's
    component: Mapped[int] = mapped_column(default=0, server_default="0")  # v8: het-job component (0: plain job)
    devices: Mapped[list[DeviceRow]] = relationship(
        back_populates="node", cascade="all, delete-orphan", order_by="DeviceRow.gpu"
    )


class DeviceRow(Base):
    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("node_id", "gpu"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    gpu: Mapped[int]
    state: Mapped[str] = mapped_column(String(16))
    node: Mapped[NodeRow] = relationship(back_populates="devices")


class RankMapRow(Base):
    __tablename__ = "rank_maps"
    __table_args__ = (UniqueConstraint("job_id", "epoch"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    epoch: Mapped[int]
    layout: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[datetime]
    ended_at: Mapped[Optional[datetime]]
    entries: Mapped[list[RankEntryRow]] = relationship(
        back_populates="rank_map", cascade="all, delete-orphan", order_by="RankEntryRow.virtual_rank"
    )


class RankEntryRow(Base):
    __tablename__ = "rank_map_entries"
    id: Mapped[int] = mapped_column(primary_key=True)
    rank_map_id: Mapped[int] = mapped_column(ForeignKey("rank_maps.id", ondelete="CASCADE"), index=True)
    virtual_rank: Mapped[int]
    node: Mapped[str] = mapped_column(String(200))
    gpu: Mapped[int]
    pp: Mapped[int]
    dp: Mapped[int]  # the data-parallel rank: DP replica x FSDP shards + FSDP shard (a TP group is (pp, dp))
    tp: Mapped[int]
    component: Mapped[int] = mapped_column(default=0, server_default="0")  # v8: het-job component of the rank
    rank_map: Mapped[RankMapRow] = relationship(back_populates="entries")


class MigrationRow(Base):
    __tablename__ = "migrations"
    __table_args__ = (Index("ix_migrations_started_at", "started_at", "id"),)  # v10: history's order, id too
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    from_layout: Mapped[str] = mapped_column(String(64))
    to_layout: Mapped[str] = mapped_column(String(64))
    trigger: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime]
    finished_at: Mapped[Optional[datetime]]
    bytes_moved: Mapped[Optional[int]] = mapped_column(BigInteger)
    bytes_checkpoint: Mapped[Optional[int]] = mapped_column(BigInteger)
    bit_exact: Mapped[Optional[bool]]
    error: Mapped[Optional[str]] = mapped_column(Text)
    plan_summary: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    fragmentation_before: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    fragmentation_after: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON)
    at_step: Mapped[Optional[int]]  # v3: the step boundary the migration applied at
    steps_lost: Mapped[Optional[int]]  # v3: committed steps redone (restored from a safety checkpoint)
    pause_s: Mapped[Optional[float]]  # v4: last committed step on the old layout -> first on the new one
    kind: Mapped[str] = mapped_column(String(16), default="live")  # v5: live (state moved) or restart (new world)
    phases: Mapped[list[MigrationPhaseRow]] = relationship(
        back_populates="migration", cascade="all, delete-orphan", order_by="MigrationPhaseRow.id"
    )


class MigrationPhaseRow(Base):
    __tablename__ = "migration_phases"
    id: Mapped[int] = mapped_column(primary_key=True)
    migration_id: Mapped[int] = mapped_column(ForeignKey("migrations.id", ondelete="CASCADE"), index=True)
    phase: Mapped[str] = mapped_column(String(16))
    seconds: Mapped[float]
    migration: Mapped[MigrationRow] = relationship(back_populates="phases")


class AdminRequestRow(Base):
    __tablename__ = "admin_requests"
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    action: Mapped[str] = mapped_column(String(16))
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    requested_by: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    message: Mapped[Optional[str]] = mapped_column(Text)
    created_at: Mapped[datetime]
    completed_at: Mapped[Optional[datetime]]
    taken_at: Mapped[Optional[datetime]]  # v10: a launcher took it (SKIP LOCKED); answered later
    taken_by: Mapped[Optional[str]] = mapped_column(String(200))  # v10: host:pid of that launcher


class AuditRowORM(Base):
    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(primary_key=True)
    who: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(200))
    result: Mapped[str] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(index=True)
    address: Mapped[Optional[str]] = mapped_column(String(64))  # v4: client address of the request


class UserRow(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    password_hash: Mapped[str] = mapped_column(String(512))
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime]
    session_version: Mapped[int] = mapped_column(default=0, server_default="0")  # v4: bumped to revoke cookies


class JobStepRow(Base):
    """v7: one committed training step as the workers report it (loss curve, step rate)."""

    __tablename__ = "job_steps"
    __table_args__ = (Index("ix_job_steps_job_step", "job_id", "step"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int]
    loss: Mapped[Optional[float]]
    layout: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime]


class ClusterSampleRow(Base):
    """v7: the cluster-wide fragmentation at one moment (the dashboard's history chart)."""

    __tablename__ = "cluster_samples"
    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(index=True)
    source: Mapped[str] = mapped_column(String(16))  # slurm or local
    gpus_total: Mapped[int]
    gpus_free: Mapped[int]
    stranded: Mapped[int]
    free_nodes: Mapped[int]
    largest_free_block: Mapped[int]
    frag_index: Mapped[float]
