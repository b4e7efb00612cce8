"""`Store`: the facade every other package uses to read and write elastic state.

Each public method is one transaction, returns plain records (db.records) or dicts, and
validates enumerated values against db.vocab before anything reaches SQL.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from sqlalchemy import Select, case, func, select
from sqlalchemy.orm import Session, selectinload

from db import placement as placement_mod
from db.base import Clock, StoreBase, from_db, to_db
from db.errors import NotFoundError
from db.models import DeviceRow, JobRow, MigrationPhaseRow, MigrationRow, NodeRow, RankEntryRow, RankMapRow
from db.placement import NodeInfo
from db.rows import job_record as _job
from db.records import Job, Migration, Node, RankEntry, RankMap
from db.sla import gpu_fraction
from db.store_admin import AdminMixin, AuditFilters
from db.store_requests import RequestsMixin
from db.store_cluster import ClusterMixin
from db.store_policy import PolicyMixin
from db.vocab import (
    JOB_MODES,
    JOB_STATES,
    MIGRATION_KINDS,
    MIGRATION_STATUSES,
    MAX_ID,
    MAX_NAME,
    MIGRATION_TRIGGERS,
    NODE_STATES,
    PHASES,
    SLA_TIERS,
    check,
)

JOB_FAILED = "job-failed"  # the audit action that says why the launcher ended a job as failed

HISTORY_COLUMNS = (
    "id", "job_id", "job_name", "kind", "trigger", "status", "from_layout", "to_layout", "started_at",
    "finished_at", "duration_s", "pause_s", *(f"{p}_s" for p in PHASES), "bytes_moved", "bytes_checkpoint",
    "bit_exact", "at_step", "steps_lost", "error", "notes",
)


def _entry(value: RankEntry | Mapping[str, Any]) -> RankEntry:
    if isinstance(value, RankEntry):
        return value
    return RankEntry(**{k: (str(value[k]) if k == "node" else int(value[k]))
                        for k in ("virtual_rank", "node", "gpu", "pp", "dp", "tp")},
                     component=int(value.get("component", 0)))


def _check_shape(node: str, gpus: int | None, component: int | None) -> None:
    if gpus is not None and (not isinstance(gpus, int) or gpus < 1):
        raise ValueError(f"node {node}: a GPU count must be a positive number, got {gpus!r}")
    if component is not None and (not isinstance(component, int) or component < 0):
        raise ValueError(f"node {node}: a heterogeneous-job component is a number from 0, got {component!r}")


def _rank_map(row: RankMapRow) -> RankMap:
    return RankMap(
        job_id=row.job_id, epoch=row.epoch, layout=row.layout, started_at=from_db(row.started_at),  # type: ignore[arg-type]
        ended_at=from_db(row.ended_at),
        entries=tuple(RankEntry(e.virtual_rank, e.node, e.gpu, e.pp, e.dp, e.tp, e.component or 0)
                      for e in row.entries),
    )


def _migration(row: MigrationRow, job_name: str) -> Migration:
    phases: dict[str, float] = {}
    for p in row.phases:
        phases[p.phase] = phases.get(p.phase, 0.0) + p.seconds
    return Migration(
        id=row.id, job_id=row.job_id, job_name=job_name, from_layout=row.from_layout,
        to_layout=row.to_layout, trigger=row.trigger, status=row.status,
        started_at=from_db(row.started_at), finished_at=from_db(row.finished_at),  # type: ignore[arg-type]
        bytes_moved=row.bytes_moved, bytes_checkpoint=row.bytes_checkpoint, bit_exact=row.bit_exact,
        error=row.error, plan_summary=dict(row.plan_summary or {}),
        fragmentation_before=dict(row.fragmentation_before or {}),
        fragmentation_after=dict(row.fragmentation_after) if row.fragmentation_after is not None else None,
        phases=phases, at_step=row.at_step, steps_lost=row.steps_lost, pause_s=row.pause_s,
        kind=row.kind or "live",
    )


def migration_notes(m: Migration) -> list[str]:
    """What happened besides the plan, one line each (the planner's notes, then the launcher's: workers
    SIGKILLed after --term-timeout, which component gave nodes back, ...): kept in the plan summary's
    `notes` (Store.add_migration_notes), shown by `elastic history` and the dashboard."""
    return [str(n) for n in m.plan_summary.get("notes") or ()]


def _history_row(m: Migration) -> dict[str, Any]:
    """A flat, JSON/CSV-ready row; the same shape for the CLI and the dashboard."""
    return {
        "id": m.id, "job_id": m.job_id, "job_name": m.job_name, "kind": m.kind, "trigger": m.trigger,
        "status": m.status, "from_layout": m.from_layout, "to_layout": m.to_layout,
        "started_at": m.started_at.isoformat(), "finished_at": m.finished_at.isoformat() if m.finished_at else None,
        "duration_s": round(m.duration_s, 3) if m.duration_s is not None else None,
        "pause_s": round(m.pause_s, 3) if m.pause_s is not None else None,
        **{f"{p}_s": round(m.phases[p], 3) if p in m.phases else None for p in PHASES},
        "bytes_moved": m.bytes_moved, "bytes_checkpoint": m.bytes_checkpoint, "bit_exact": m.bit_exact,
        "at_step": m.at_step, "steps_lost": m.steps_lost, "error": m.error, "notes": migration_notes(m),
    }


class Store(RequestsMixin, AdminMixin, ClusterMixin, PolicyMixin, StoreBase):
    """The only way to touch the elastic database.

    `Store(url)` opens (creating if needed) and upgrades the schema; `Store(url, readonly=True)`
    opens it read-only and refuses an older or foreign schema (`elastic history`); `Store(url, create=False)`
    refuses to create anything, for read-only tools like `elastic history`. Raises
    db.DatabaseError with a clear message when the URL cannot be used.
    """

    def __init__(self, url: str, *, create: bool = True, clock: Clock | None = None, readonly: bool = False,
                 upgrade_schema: bool = True, pool_size: int | None = None) -> None:
        super().__init__(url, create=create, clock=clock, readonly=readonly, upgrade_schema=upgrade_schema,
                         pool_size=pool_size)

    # ----------------------------------------------------------------- jobs
    def create_job(
        self,
        name: str,
        layout: str,
        gpus_per_node: int,
        max_devices: int,
        *,
        slurm_job_id: str | None = None,
        pinned_node: str | None = None,
        sla_tier: str = "standard",
        state: str = "running",
        nodes: Sequence[str] = (),
        min_nodes: int = 1,
        mode: str = "live",
        node_gpus: Mapping[str, int] | None = None,
        components: Mapping[str, int] | None = None,
        max_nodes: int | None = None,
        owner: str | None = None,
        owner_uid: int | None = None,
    ) -> int:
        """Register a job (and its nodes; the pinned node is marked pinned); returns its id.
        min_nodes: the launcher's --nnodes MIN, below which no admin request may take the job;
        mode: live (the program uses the runtime API) or restart (torchrun's contract);
        node_gpus / components: each node's GPU count (uneven nodes; default gpus_per_node) and
        heterogeneous-job component (default 0); max_nodes: the launcher's --nnodes MAX (requests never
        go above it; None: max_devices over gpus_per_node); owner / owner_uid: the Unix user it belongs to (the
        service sets them from the caller's munge credential, never from an argument)."""
        check("job state", state, JOB_STATES)
        check("job mode", mode, JOB_MODES)
        check("SLA tier", sla_tier, SLA_TIERS)
        for what, text in (("job name", name), *(("node name", n) for n in nodes)):
            if not 0 < len(text) <= MAX_NAME:  # PostgreSQL enforces VARCHAR(200), SQLite would not
                raise ValueError(f"a {what} has 1 to {MAX_NAME} characters, not {len(text)}")
        if gpus_per_node <= 0 or max_devices <= 0 or min_nodes <= 0 or (max_nodes is not None and max_nodes <= 0):
            raise ValueError("gpus_per_node, max_devices, min_nodes and max_nodes must be positive")
        now = self.now()
        with self._tx() as s:
            job = JobRow(name=name, slurm_job_id=slurm_job_id, state=state, layout=layout,
                         gpus_per_node=gpus_per_node, pinned_node=pinned_node, max_devices=max_devices,
                         sla_tier=sla_tier, created_at=now, updated_at=now, min_nodes=min_nodes,
                         mode=mode, max_nodes=max_nodes, owner=owner, owner_uid=owner_uid)
            s.add(job)
            s.flush()
            names = list(dict.fromkeys([*nodes, *([pinned_node] if pinned_node else [])]))
            for n in names:
                s.add(self._new_node(job, n, "active", n == pinned_node, (node_gpus or {}).get(n),
                                     (components or {}).get(n, 0)))
            return job.id

    @staticmethod
    def _new_node(job: JobRow, name: str, state: str, pinned: bool, gpus: int | None = None,
                  component: int = 0) -> NodeRow:
        _check_shape(name, gpus, component)
        node = NodeRow(job_id=job.id, name=name, state=state, pinned=pinned, gpus=gpus, component=component)
        node.devices = [DeviceRow(gpu=g, state="idle") for g in range(gpus or job.gpus_per_node)]
        return node

    def _job_row(self, s: Session, job_id: int) -> JobRow:
        row = s.get(JobRow, job_id)
        if row is None:
            raise NotFoundError(f"no job with id {job_id}")
        return row

    def get_job(self, job_id: int) -> Job | None:
        """The job, or None (also for ids no database column can hold, e.g. 2**64 from a URL)."""
        if not 0 < job_id <= MAX_ID:
            return None
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            return _job(row) if row else None

    def find_job(self, ref: int | str, owner: str | None = None) -> Job | None:
        """A job by id (int or digits) or by name (the newest job of that name; of `owner`'s jobs when given,
        since two users may both name a job `train`)."""
        if isinstance(ref, int) or (isinstance(ref, str) and ref.isascii() and ref.isdigit()):
            return self.get_job(int(ref))
        with self._tx() as s:
            q = select(JobRow).where(JobRow.name == ref)
            if owner is not None:
                q = q.where(JobRow.owner == owner)
            row = s.scalars(q.order_by(JobRow.id.desc())).first()
            return _job(row) if row else None

    def list_jobs(self, state: str | None = None, owner: str | None = None) -> list[Job]:
        """Every job (of `owner` only, when given), by id."""
        with self._tx() as s:
            q = select(JobRow).order_by(JobRow.id)
            if owner is not None:
                q = q.where(JobRow.owner == owner)
            if state is not None:
                q = q.where(JobRow.state == check("job state", state, JOB_STATES))
            return [_job(r) for r in s.scalars(q)]

    def set_job_state(self, job_id: int, state: str, why: str | None = None) -> None:
        """`why`: one line saying why a job failed (the launcher's own message), kept in the audit log
        (action JOB_FAILED) and shown by `elastic jobs` and the job page (Store.why_failed)."""
        check("job state", state, JOB_STATES)
        with self._tx() as s:
            row = self._job_row(s, job_id)
            row.state, row.updated_at = state, self.now()
            if state in ("finished", "failed", "stopped"):
                for rm in s.scalars(select(RankMapRow).where(RankMapRow.job_id == job_id,
                                                             RankMapRow.ended_at.is_(None))):
                    rm.ended_at = row.updated_at
        if why and state == "failed":
            self.audit("elastic-launch", JOB_FAILED, f"job:{job_id}", why)

    def why_failed(self, job_id: int) -> str | None:
        """Why a failed job failed, as the launcher said when it gave up (None: not failed, or not said)."""
        job = self.get_job(job_id)
        if job is None or job.state != "failed":
            return None
        rows = self.audit_log(1, filters=AuditFilters(action=JOB_FAILED, target=f"job:{job_id}"))
        return rows[0].result if rows else None

    def update_job(
        self,
        job_id: int,
        *,
        slurm_job_id: str | None = None,
        pinned_node: str | None = None,
        max_devices: int | None = None,
        sla_tier: str | None = None,
        min_nodes: int | None = None,
        mode: str | None = None,
        last_step: int | None = None,
        layout: str | None = None,
        max_nodes: int | None = None,
    ) -> None:
        """Change job attributes learnt later (e.g. the Slurm id once sbatch answers, the mode once the
        workers register, the last step seen); None = keep."""
        if mode is not None:
            check("job mode", mode, JOB_MODES)
        if sla_tier is not None:
            check("SLA tier", sla_tier, SLA_TIERS)
        if any(v is not None and v <= 0 for v in (max_devices, min_nodes, max_nodes)):
            raise ValueError("max_devices, min_nodes and max_nodes must be positive")
        with self._tx() as s:
            row = self._job_row(s, job_id)
            for name, value in (("slurm_job_id", slurm_job_id), ("pinned_node", pinned_node),
                                ("max_devices", max_devices), ("sla_tier", sla_tier), ("min_nodes", min_nodes),
                                ("mode", mode), ("last_step", last_step), ("layout", layout),
                                ("max_nodes", max_nodes)):
                if value is not None:
                    setattr(row, name, value)
            row.updated_at = self.now()

    def heartbeat(self, job_id: int, checkpoint: tuple[str, int] | None = None) -> None:
        """The job's launcher is alive (db.liveness); `checkpoint`: the newest complete safety checkpoint
        (path, step), what a later `elastic-launch --resume` of a lost job goes on from."""
        with self._tx() as s:
            row = self._job_row(s, job_id)
            row.heartbeat_at = self.now()
            if checkpoint is not None and row.state == "running":
                row.checkpoint_path, row.checkpoint_step = checkpoint

    def set_checkpoint(self, job_id: int, path: str | None, step: int | None, *, state: str | None = None) -> None:
        """Remember the checkpoint the job resumes from (and optionally set its state, e.g. suspended)."""
        if state is not None:
            check("job state", state, JOB_STATES)
        with self._tx() as s:
            row = self._job_row(s, job_id)
            row.checkpoint_path, row.checkpoint_step = path, step
            if state is not None:
                row.state = state
            row.updated_at = self.now()

    # ---------------------------------------------------------------- nodes
    def set_node_state(self, job_id: int, node: str, state: str, *, pinned: bool | None = None,
                       gpus: int | None = None, component: int | None = None) -> None:
        """Set a node's state (creating the node row if new); failed nodes fail their devices.
        gpus / component (None = keep): the node's GPU count and heterogeneous-job component, e.g. for
        a node a grow acquired."""
        check("node state", state, NODE_STATES)
        _check_shape(node, gpus, component)
        with self._tx() as s:
            job = self._job_row(s, job_id)
            row = s.scalars(select(NodeRow).where(NodeRow.job_id == job_id, NodeRow.name == node)).first()
            if row is None:
                row = self._new_node(job, node, state, bool(pinned), gpus, component or 0)
                s.add(row)
            row.state = state
            if pinned is not None:
                row.pinned = pinned
            if component is not None:
                row.component = component
            if gpus is not None and gpus != row.gpus:
                row.gpus = gpus
                have = {d.gpu for d in row.devices}
                row.devices.extend(DeviceRow(gpu=g, state="idle") for g in range(gpus) if g not in have)
                for d in [d for d in row.devices if d.gpu >= gpus and d.state == "idle"]:
                    row.devices.remove(d)
            if state == "failed":
                for d in row.devices:
                    d.state = "failed"
            job.updated_at = self.now()

    def list_nodes(self, job_id: int) -> list[Node]:
        with self._tx() as s:
            rows = s.scalars(select(NodeRow).where(NodeRow.job_id == job_id).order_by(NodeRow.id)
                             .options(selectinload(NodeRow.devices)))
            return [Node(r.job_id, r.name, r.state, r.pinned, {d.gpu: d.state for d in r.devices},
                         r.gpus or len(r.devices), r.component or 0) for r in rows]

    # ------------------------------------------------------------ rank maps
    def record_rank_map(
        self, job_id: int, epoch: int, layout: str, entries: Iterable[RankEntry | Mapping[str, Any]]
    ) -> None:
        """Start epoch `epoch` with this placement: closes the previous map, updates the job's
        layout, node states and device occupancy, all in one transaction."""
        items = [_entry(e) for e in entries]
        if len({(e.node, e.gpu) for e in items}) != len(items):
            raise ValueError("rank map places two ranks on one device")
        if len({e.virtual_rank for e in items}) != len(items):
            raise ValueError("rank map repeats a virtual rank")
        if any(e.component < 0 for e in items):
            raise ValueError("a heterogeneous-job component is a number from 0")
        if len({(e.node, e.component) for e in items}) != len({e.node for e in items}):
            raise ValueError("rank map puts one node in two components")
        now = self.now()
        with self._tx() as s:
            job = self._job_row(s, job_id)
            for prev in s.scalars(select(RankMapRow).where(RankMapRow.job_id == job_id,
                                                           RankMapRow.ended_at.is_(None))):
                if prev.epoch >= epoch:
                    raise ValueError(f"epoch {epoch} is not after the current epoch {prev.epoch}")
                prev.ended_at = now
            rm = RankMapRow(job_id=job_id, epoch=epoch, layout=layout, started_at=now, ended_at=None)
            rm.entries = [RankEntryRow(virtual_rank=e.virtual_rank, node=e.node, gpu=e.gpu, pp=e.pp,
                                       dp=e.dp, tp=e.tp, component=e.component)
                          for e in sorted(items, key=lambda e: e.virtual_rank)]
            s.add(rm)
            job.layout, job.updated_at = layout, now
            self._sync_devices(s, job, items)

    def _sync_devices(self, s: Session, job: JobRow, items: list[RankEntry]) -> None:
        used = {(e.node, e.gpu) for e in items}
        nodes = {n.name: n for n in s.scalars(select(NodeRow).where(NodeRow.job_id == job.id)
                                               .options(selectinload(NodeRow.devices)))}
        component = {e.node: e.component for e in items}
        for name in sorted(set(component) - set(nodes)):
            nodes[name] = self._new_node(job, name, "active", name == job.pinned_node, component=component[name])
            s.add(nodes[name])
        for name, comp in component.items():
            nodes[name].component = comp  # a node's ranks say which component it belongs to
        for name, node in nodes.items():
            have = {d.gpu: d for d in node.devices}
            for gpu in {g for n, g in used if n == name} - set(have):
                node.devices.append(DeviceRow(gpu=gpu, state="idle"))
            for d in node.devices:
                if d.state != "failed":
                    d.state = "used" if (name, d.gpu) in used else "idle"
            busy = any(n == name for n, _ in used)
            if busy:
                node.state = "active"
            elif node.state == "active" and not node.pinned:
                node.state = "idle"

    def current_rank_map(self, job_id: int) -> RankMap | None:
        with self._tx() as s:
            row = s.scalars(select(RankMapRow).where(RankMapRow.job_id == job_id)
                            .order_by(RankMapRow.epoch.desc()).options(selectinload(RankMapRow.entries))).first()
            return _rank_map(row) if row else None

    def rank_maps(self, job_id: int) -> list[RankMap]:
        """Every epoch of a job, oldest first (entries included)."""
        with self._tx() as s:
            rows = s.scalars(select(RankMapRow).where(RankMapRow.job_id == job_id)
                             .order_by(RankMapRow.epoch).options(selectinload(RankMapRow.entries)))
            return [_rank_map(r) for r in rows]

    def devices_held(self, job_id: int) -> int:
        """Devices in the job's current rank map (0 when it has none)."""
        with self._tx() as s:
            return self._devices_held(s, job_id)

    @staticmethod
    def _devices_held(s: Session, job_id: int) -> int:
        rm_id = s.scalar(select(RankMapRow.id).where(RankMapRow.job_id == job_id)
                         .order_by(RankMapRow.epoch.desc()).limit(1))
        if rm_id is None:
            return 0
        return int(s.scalar(select(func.count()).where(RankEntryRow.rank_map_id == rm_id)) or 0)

    def placement(self, job_id: int) -> dict[str, Any]:
        """Everything the placement view draws: grid rows, fragmentation, epoch, other jobs."""
        job = self.get_job(job_id)
        if job is None:
            raise NotFoundError(f"no job with id {job_id}")
        current = self.current_rank_map(job_id)
        nodes = self.list_nodes(job_id)
        entries = current.entries if current else ()
        names = {n.name for n in nodes} | {e.node for e in entries}
        others = self._others_on(job_id, names)
        infos = [NodeInfo(n.name, n.state, n.pinned, n.gpus, n.component) for n in nodes]
        failed = [(n.name, g) for n in nodes for g, st in n.devices.items() if st == "failed"]
        grid = placement_mod.grid(entries, infos, job.gpus_per_node, others, failed)
        components = sorted({r["component"] for r in grid})
        return {
            "job": job,
            "epoch": current.epoch if current else None,
            "layout": current.layout if current else job.layout,
            "started_at": current.started_at if current else None,
            "grid": grid,
            "width": max((len(r["cells"]) for r in grid), default=0),  # the widest node's GPUs
            "components": components if components != [0] else [],  # het-job components (none: a plain job)
            "fragmentation": placement_mod.fragmentation(entries, infos, job.gpus_per_node, others),
            "pp_stages": len({e.pp for e in entries}),
            "tp_groups": len({(e.pp, e.dp) for e in entries}),
        }

    def _others_on(self, job_id: int, nodes: set[str]) -> dict[tuple[str, int], str]:
        """(node, gpu) -> name of another running/suspended job whose current rank map uses it: one query."""
        if not nodes:
            return {}
        latest = (select(RankMapRow.job_id, func.max(RankMapRow.epoch).label("epoch"))
                  .group_by(RankMapRow.job_id).subquery())
        q = (select(RankEntryRow.node, RankEntryRow.gpu, JobRow.name)
             .join(RankMapRow, RankMapRow.id == RankEntryRow.rank_map_id)
             .join(latest, (latest.c.job_id == RankMapRow.job_id) & (latest.c.epoch == RankMapRow.epoch))
             .join(JobRow, JobRow.id == RankMapRow.job_id)
             .where(JobRow.id != job_id, JobRow.state.in_(("running", "suspended")),
                    RankEntryRow.node.in_(sorted(nodes)))
             .order_by(JobRow.id))
        with self._tx() as s:
            return {(node, gpu): name for node, gpu, name in s.execute(q)}

    def fragmentation(self, job_id: int) -> dict[str, Any]:
        """Current fragmentation summary: pass it to start_migration / finish_migration."""
        return self.placement(job_id)["fragmentation"]

    # ----------------------------------------------------------- migrations
    def start_migration(
        self,
        job_id: int,
        from_layout: str,
        to_layout: str,
        trigger: str,
        plan_summary: dict[str, Any],
        fragmentation_before: dict[str, Any],
        *,
        status: str = "running",
        kind: str = "live",
    ) -> int:
        """Record that a migration began (status running, or planned); returns its id. kind: live (state
        moved between running workers) or restart (every worker stopped, a new world started)."""
        check("trigger", trigger, MIGRATION_TRIGGERS)
        check("migration kind", kind, MIGRATION_KINDS)
        check("migration status", status, ("planned", "running"))
        with self._tx() as s:
            self._job_row(s, job_id)
            row = MigrationRow(job_id=job_id, from_layout=from_layout, to_layout=to_layout, trigger=trigger,
                               status=status, kind=kind, started_at=self.now(), plan_summary=dict(plan_summary),
                               fragmentation_before=dict(fragmentation_before))
            s.add(row)
            s.flush()
            return row.id

    def finish_migration(
        self,
        mid: int,
        status: str,
        bytes_moved: int | None,
        bytes_checkpoint: int | None,
        bit_exact: bool | None,
        phases: Mapping[str, float],
        error: str | None = None,
        fragmentation_after: dict[str, Any] | None = None,
        *,
        at_step: int | None = None,
        steps_lost: int | None = None,
    ) -> None:
        """Close a migration with its outcome and per-phase seconds (names from db.vocab.PHASES);
        at_step: the step the new layout went on from; steps_lost: committed steps that must be redone;
        status declined: the migration was given up with nothing wrong (training ended first), `error` says why."""
        check("migration status", status, ("succeeded", "failed", "declined"))
        for name, seconds in phases.items():
            check("phase", name, PHASES)
            if seconds < 0:
                raise ValueError(f"phase {name} has negative seconds {seconds}")
        with self._tx() as s:
            row = s.get(MigrationRow, mid)
            if row is None:
                raise NotFoundError(f"no migration with id {mid}")
            row.status, row.finished_at = status, self.now()
            row.bytes_moved, row.bytes_checkpoint, row.bit_exact = bytes_moved, bytes_checkpoint, bit_exact
            row.error = error
            row.fragmentation_after = dict(fragmentation_after) if fragmentation_after is not None else None
            row.at_step, row.steps_lost = at_step, steps_lost
            row.phases = [MigrationPhaseRow(phase=k, seconds=float(v)) for k, v in phases.items()]

    def add_migration_notes(self, mid: int, notes: Sequence[str]) -> None:
        """Append `notes` to migration `mid`'s plan summary (`notes`, a list of lines): what happened
        besides the plan, e.g. which component of a heterogeneous job gave nodes back, or the fallback
        taken where Slurm refused a release. No schema change: the summary is a JSON column."""
        with self._tx() as s:
            row = s.get(MigrationRow, mid)
            if row is None:
                raise NotFoundError(f"no migration with id {mid}")
            summary = dict(row.plan_summary or {})
            summary["notes"] = [*summary.get("notes", []), *map(str, notes)]
            row.plan_summary = summary  # a new dict, so SQLAlchemy sees the change

    def set_pause(self, mid: int, pause_s: float) -> None:
        """Record how long training stood still for migration `mid`: from the last committed step on
        the old layout to the first committed step on the new one (known only after that step)."""
        if not pause_s >= 0:
            raise ValueError(f"pause must be a non-negative number of seconds, got {pause_s}")
        with self._tx() as s:
            row = s.get(MigrationRow, mid)
            if row is None:
                raise NotFoundError(f"no migration with id {mid}")
            row.pause_s = float(pause_s)

    def set_resume_step(self, mid: int, at_step: int, steps_lost: int) -> None:
        """Record where a restart's new world went on from (at_step) and the steps it ran again (steps_lost):
        known only once the script reported its first step there (launcher.loop.restart), after the
        restart itself was finished."""
        if at_step < 0 or steps_lost < 0:
            raise ValueError(f"at_step {at_step} and steps_lost {steps_lost} must be non-negative")
        with self._tx() as s:
            row = s.get(MigrationRow, mid)
            if row is None:
                raise NotFoundError(f"no migration with id {mid}")
            row.at_step, row.steps_lost = int(at_step), int(steps_lost)

    def get_migration(self, mid: int) -> Migration | None:
        if not 0 < mid <= MAX_ID:
            return None
        with self._tx() as s:
            row = s.get(MigrationRow, mid, options=[selectinload(MigrationRow.phases)])
            if row is None:
                return None
            return _migration(row, s.get(JobRow, row.job_id).name)  # type: ignore[union-attr]

    def recent_migrations(self, job_id: int, limit: int = 5) -> list[Migration]:
        """A job's latest migrations (with fragmentation before/after), newest first."""
        with self._tx() as s:
            job = self._job_row(s, job_id)
            rows = s.scalars(select(MigrationRow).where(MigrationRow.job_id == job_id)
                             .order_by(MigrationRow.id.desc()).limit(limit)
                             .options(selectinload(MigrationRow.phases)))
            return [_migration(r, job.name) for r in rows]

    def _history_query(
        self, job: int | str | None, since: datetime | None, until: datetime | None,
        trigger: str | None, status: str | None, owner: str | None = None,
    ) -> Select[Any]:
        q = select(MigrationRow, JobRow.name).join(JobRow, JobRow.id == MigrationRow.job_id)
        if owner is not None:  # a user who may see only their own jobs (the service's private_jobs)
            q = q.where(JobRow.owner == owner)
        if job is not None:
            if isinstance(job, bool) or not isinstance(job, (int, str)):
                raise ValueError("job filter must be an id or a name")
            if isinstance(job, int) and not 0 <= job <= MAX_ID:
                raise ValueError(f"job id {job} is out of range")
            q = q.where(MigrationRow.job_id == job if isinstance(job, int) else JobRow.name == job)
        if since is not None:
            q = q.where(MigrationRow.started_at >= to_db(since))
        if until is not None:
            q = q.where(MigrationRow.started_at <= to_db(until))
        if trigger is not None:
            q = q.where(MigrationRow.trigger == check("trigger", trigger, MIGRATION_TRIGGERS))
        if status is not None:
            q = q.where(MigrationRow.status == check("status", status, MIGRATION_STATUSES))
        return q

    def history(
        self,
        job: int | str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        trigger: str | None = None,
        status: str | None = None,
        limit: int = 50,
        offset: int = 0,
        owner: str | None = None,
    ) -> list[dict[str, Any]]:
        """Migrations matching the filters (of `owner`'s jobs only, when given), newest first, as flat dicts
        (HISTORY_COLUMNS)."""
        if limit < 0 or offset < 0:
            raise ValueError("limit and offset must not be negative")
        q = self._history_query(job, since, until, trigger, status, owner)
        q = q.order_by(MigrationRow.started_at.desc(), MigrationRow.id.desc()).limit(limit).offset(offset)
        with self._tx() as s:
            rows = s.execute(q.options(selectinload(MigrationRow.phases))).all()
            return [_history_row(_migration(m, name)) for m, name in rows]

    def history_count(
        self,
        job: int | str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        trigger: str | None = None,
        status: str | None = None,
        owner: str | None = None,
    ) -> int:
        """How many migrations history() would return without limit/offset (for paging)."""
        q = self._history_query(job, since, until, trigger, status, owner)
        with self._tx() as s:
            return int(s.scalar(select(func.count()).select_from(q.subquery())) or 0)

    # ------------------------------------------------------------------ SLA
    @staticmethod
    def _sla_end(job: JobRow, now: datetime) -> datetime:
        """Where a job's SLA clock stops: now, or when it ended."""
        return min(now, job.updated_at) if job.state in ("finished", "failed", "stopped") else now

    def gpu_fraction_sla(self, job_id: int, now: datetime | None = None) -> float | None:
        """Ideal time / real time (see db.sla); None before the first rank map."""
        with self._tx() as s:
            job = self._job_row(s, job_id)
            rows = self._overview_rows(s, [job], to_db(now) if now else self.now())
            return rows[0]["sla"]

    def jobs_overview(self) -> list[dict[str, Any]]:
        """One dict per job (all of them, by id) for the overview: job, devices held, SLA and its target."""
        with self._tx() as s:
            return self._overview_rows(s, list(s.scalars(select(JobRow).order_by(JobRow.id))), self.now())

    def jobs_page(self, states: Sequence[str] | None = None, name: str | None = None, limit: int = 50,
                  offset: int = 0, owner: str | None = None) -> tuple[list[dict[str, Any]], int]:
        """One page of the overview and the number of matching jobs, in four queries whatever the page
        size: running jobs first (then suspended, stopped, finished, failed), newest first within a state.

        states: only these (None = all); name: jobs whose name contains this text, ignoring case on every
        backend (SQLite's LIKE always ignored it; PostgreSQL's does not, hence ILIKE there); owner: that
        user's jobs only (a user who may not see others' jobs)."""
        for state in states or ():
            check("job state", state, JOB_STATES)
        q = select(JobRow)
        if states is not None:
            q = q.where(JobRow.state.in_(list(states)))
        if name:
            q = q.where(JobRow.name.icontains(name, autoescape=True))
        if owner is not None:
            q = q.where(JobRow.owner == owner)
        rank = case({st: i for i, st in enumerate(JOB_STATES)}, value=JobRow.state, else_=len(JOB_STATES))
        with self._tx() as s:
            total = int(s.scalar(select(func.count()).select_from(q.subquery())) or 0)
            jobs = list(s.scalars(q.order_by(rank, JobRow.id.desc()).limit(limit).offset(offset)))
            return self._overview_rows(s, jobs, self.now()), total

    def _overview_rows(self, s: Session, jobs: list[JobRow], now: datetime) -> list[dict[str, Any]]:
        """Devices held and SLA for these jobs with two queries in all (epochs with their sizes, migrations)."""
        ids = [j.id for j in jobs]
        epochs: dict[int, list[tuple[int, datetime, datetime | None, int]]] = {i: [] for i in ids}
        migs: dict[int, list[tuple[datetime, datetime | None]]] = {i: [] for i in ids}
        if ids:
            for job_id, epoch, started, ended, devices in s.execute(
                    select(RankMapRow.job_id, RankMapRow.epoch, RankMapRow.started_at, RankMapRow.ended_at,
                           func.count(RankEntryRow.id))
                    .join(RankEntryRow, RankEntryRow.rank_map_id == RankMapRow.id, isouter=True)
                    .where(RankMapRow.job_id.in_(ids)).group_by(RankMapRow.id)):
                epochs[job_id].append((epoch, started, ended, int(devices)))
            for job_id, started, finished in s.execute(
                    select(MigrationRow.job_id, MigrationRow.started_at, MigrationRow.finished_at)
                    .where(MigrationRow.job_id.in_(ids))):
                migs[job_id].append((started, finished))
        out = []
        for job in jobs:
            mine = epochs[job.id]
            sla = gpu_fraction([(a, b, n) for _, a, b, n in mine], migs[job.id], job.max_devices,
                               self._sla_end(job, now))
            target = SLA_TIERS.get(job.sla_tier, SLA_TIERS["standard"])
            out.append({"job": _job(job), "devices_held": max(mine)[3] if mine else 0, "sla": sla,
                        "sla_target": target, "sla_ok": None if sla is None else sla >= target,
                        "launch_spec": dict(job.launch_spec) if job.launch_spec else None})
        return out
