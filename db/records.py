"""Plain, immutable values returned by `Store`, so no caller ever holds an ORM object
(or a session) and results can be passed across threads or serialized as-is."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


@dataclass(frozen=True)
class Job:
    id: int
    name: str
    slurm_job_id: str | None
    state: str
    layout: str
    gpus_per_node: int
    pinned_node: str | None
    max_devices: int
    sla_tier: str
    created_at: datetime
    updated_at: datetime
    checkpoint_path: str | None = None  # the checkpoint a suspended job resumes from
    checkpoint_step: int | None = None
    min_nodes: int = 1  # the launcher's --nnodes MIN: no request may leave the job below it
    mode: str = "live"  # live (runtime API) or restart (torchrun's contract)
    last_step: int | None = None  # last finished training step the launcher saw
    max_nodes: int | None = None  # the launcher's --nnodes MAX (None: recorded before v9)
    heartbeat_at: datetime | None = None  # the launcher's last heartbeat (None: before v10, or none yet)
    policy: str = "manual"  # who resizes it: people only, or the launcher too (--policy opportunistic)
    policy_watch: dict[str, Any] | None = None  # the policy's last look at the cluster (launcher.loop.autoscale)
    owner: str | None = None  # the Unix user whose launcher created it (None: recorded before v12)
    owner_uid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["created_at"], d["updated_at"] = _iso(self.created_at), _iso(self.updated_at)
        d["heartbeat_at"] = _iso(self.heartbeat_at)
        return d


@dataclass(frozen=True)
class Node:
    job_id: int
    name: str
    state: str
    pinned: bool
    devices: dict[int, str] = field(default_factory=dict)  # gpu index -> used/idle/failed
    gpus: int = 0  # the node's GPU count (nodes may differ); 0: unknown (the job's gpus_per_node)
    component: int = 0  # the heterogeneous job's component the node belongs to (0: a plain job)


@dataclass(frozen=True)
class RankEntry:
    """Where one virtual rank runs (node, GPU, and the heterogeneous job's component: 0 for a plain
    job), and its coordinates in the PP x DP x TP grid."""

    virtual_rank: int
    node: str
    gpu: int
    pp: int
    dp: int
    tp: int
    component: int = 0


@dataclass(frozen=True)
class RankMap:
    job_id: int
    epoch: int
    layout: str
    started_at: datetime
    ended_at: datetime | None
    entries: tuple[RankEntry, ...]


@dataclass(frozen=True)
class Migration:
    id: int
    job_id: int
    job_name: str
    from_layout: str
    to_layout: str
    trigger: str
    status: str
    started_at: datetime
    finished_at: datetime | None
    bytes_moved: int | None
    bytes_checkpoint: int | None
    bit_exact: bool | None
    error: str | None
    plan_summary: dict[str, Any]
    fragmentation_before: dict[str, Any]
    fragmentation_after: dict[str, Any] | None
    phases: dict[str, float]
    at_step: int | None = None
    steps_lost: int | None = None
    pause_s: float | None = None  # training stood still this long (last old commit -> first new commit)
    kind: str = "live"  # live: state moved between running workers; restart: the workers were restarted

    @property
    def duration_s(self) -> float | None:
        if self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


@dataclass(frozen=True)
class AdminRequest:
    id: int
    job_id: int
    action: str
    params: dict[str, Any]
    requested_by: str
    status: str
    message: str | None
    created_at: datetime
    completed_at: datetime | None
    taken_at: datetime | None = None  # v10: when a launcher took it (still pending until answered)
    taken_by: str | None = None  # v10: which launcher (host:pid)


@dataclass(frozen=True)
class AuditRow:
    id: int
    who: str
    action: str
    target: str
    result: str
    at: datetime
    address: str | None = None  # client address (dashboard requests), None for CLI and launcher rows


@dataclass(frozen=True)
class User:
    """A dashboard user; the password hash never leaves the store."""

    name: str
    role: str
    session_version: int = 0  # sessions carry it; logout and password changes bump it

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


@dataclass(frozen=True)
class StepRecord:
    """One committed training step as reported by the workers (v5)."""

    job_id: int
    step: int
    loss: float | None
    layout: str
    at: datetime


@dataclass(frozen=True)
class Fragmentation:
    """Cluster-wide figures (see dashboard.cluster for the definitions); `index` = stranded / free GPUs."""

    gpus_total: int
    gpus_free: int
    stranded: int
    free_nodes: int
    largest_free_block: int
    index: float


@dataclass(frozen=True)
class ClusterSample:
    """Cluster-wide fragmentation at one moment (v7), as the dashboard's history chart draws it."""

    at: datetime
    source: str
    figures: Fragmentation
