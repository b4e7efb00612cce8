"""Where the cluster view's data comes from: Slurm (through dashboard.slurm_reader) or, on the
embedded default without Slurm, the local backend's simulated nodes in our database.

The app config chooses: CLUSTER_SOURCE = "auto" (default: Slurm when `sinfo` answers, else
local), "slurm" (an unreachable Slurm is an error on the page) or "local"; CLUSTER_PARTITIONS
(comma-separated, default all); SLURM_ENV (extra environment for the commands, e.g. SLURM_CONF).
A snapshot is cached for CLUSTER_CACHE_SECONDS (default 1), unless our database's placements
changed meanwhile, so the page, its partials and the refreshes live events cause share one set
of Slurm calls; each fresh one is also stored as a fragmentation
sample, at most one per CLUSTER_SAMPLE_SECONDS (default 30).
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from dashboard.cluster import ClusterView, ElasticJob, build_from_slurm, build_local
from dashboard.slurm_reader import SlurmReadError, read_slurm
from db.records import ClusterSample

if TYPE_CHECKING:
    from db.store import Store

ACTIVE_JOB_STATES = ("running", "suspended")
SLURM_RETRY_S = 30.0  # auto mode: how long a Slurm that did not answer is left alone


def elastic_jobs(store: "Store") -> list[ElasticJob]:
    """The running (or suspended) jobs of our database, with their current ranks and held nodes."""
    out = []
    for job in store.list_jobs():
        if job.state not in ACTIVE_JOB_STATES:
            continue
        rank_map = store.current_rank_map(job.id)
        spec = store.launch_spec(job.id) or {}
        nodes = store.list_nodes(job.id)
        held = tuple(n.name for n in nodes if n.state in ("active", "idle"))
        out.append(ElasticJob(job.id, job.name, job.slurm_job_id, rank_map.layout if rank_map else job.layout,
                              job.gpus_per_node, job.pinned_node, int(spec.get("min_nodes") or job.min_nodes or 1),
                              rank_map.entries if rank_map else (), held, {n.name: n.gpus for n in nodes},
                              {n.name: n.component for n in nodes}, job.owner or ""))
    return out


def failed_nodes(store: "Store") -> set[str]:
    return {n.name for job in store.list_jobs() if job.state in ACTIVE_JOB_STATES
            for n in store.list_nodes(job.id) if n.state == "failed"}


class ClusterSource:
    """One per app: reads the cluster (cached briefly, thread-safe) and records samples."""

    def __init__(self, config: dict[str, Any], store: "Store") -> None:
        self.mode = str(config.get("CLUSTER_SOURCE", "auto"))
        if self.mode not in ("auto", "slurm", "local"):
            raise ValueError(f"CLUSTER_SOURCE must be auto, slurm or local, not {self.mode!r}")
        self.partitions = [p for p in str(config.get("CLUSTER_PARTITIONS", "")).split(",") if p]
        self.env = dict(config.get("SLURM_ENV") or {})
        self.cache_s = float(config.get("CLUSTER_CACHE_SECONDS", 1.0))
        self.sample_s = float(config.get("CLUSTER_SAMPLE_SECONDS", 30.0))
        self.store = store
        self._lock = threading.Lock()
        self._cached: tuple[float, ClusterView | None, str | None] = (0.0, None, None)
        self._why: str | None = None  # auto mode: why the view is the local one
        self._slurm_down_until = 0.0
        self._marks: tuple[Any, ...] = ()  # auto mode: after a failure, do not ask Slurm again for a while

    def view(self) -> tuple[ClusterView, str | None]:
        """(the view, a one-line warning or None). With "auto", a Slurm that does not answer
        falls back to the local view and says why; with "slurm" it is an error (SlurmReadError)."""
        marks = self.store.change_marks()["placement"]  # a placement change in our database: read afresh
        with self._lock:
            at, cached, warning = self._cached
            if cached is not None and time.monotonic() - at < self.cache_s and marks == self._marks:
                return cached, warning
            view, warning = self._read()
            self._cached, self._marks = (time.monotonic(), view, warning), marks
            self._sample(view)  # only fresh reads: a cached view was sampled when it was read
        return view, warning

    def _read(self) -> tuple[ClusterView, str | None]:
        jobs = elastic_jobs(self.store)
        if self.mode == "slurm" or (self.mode == "auto" and time.monotonic() >= self._slurm_down_until):
            try:
                return build_from_slurm(read_slurm(self.env, timeout=10.0 if self.mode == "slurm" else 5.0),
                                         jobs, self.partitions), None
            except SlurmReadError as exc:
                if self.mode == "slurm":
                    raise
                self._slurm_down_until = time.monotonic() + SLURM_RETRY_S
                self._why = f"Slurm not reachable ({exc}); showing the local backend's nodes"
        return build_local(jobs, failed_nodes(self.store)), self._why if self.mode == "auto" else None

    def _sample(self, view: ClusterView) -> None:
        self.store.add_cluster_sample(ClusterSample(self.store.now(), view.source, view.fragmentation),
                                      min_interval_s=self.sample_s)

    def invalidate(self) -> None:
        """Forget the cached snapshot (after an action, so the next read is fresh)."""
        with self._lock:
            self._cached = (0.0, None, None)
