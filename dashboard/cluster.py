"""The admin's cluster view as plain values: every node drawn as GPUs, each GPU with the job on it,
and cluster-wide fragmentation. Pure functions: no Flask, no database, no subprocess, so tests
build views from recorded Slurm output and from hand-made rank maps alike.

Two sources of truth:
  * Slurm (`build_from_slurm`): nodes and every job from sinfo/squeue; our database only adds
    which Slurm jobs are elastic (the job id, or its companion jobs `<name>-companion-<n>`) and
    where each elastic rank runs. An elastic rank on its job's k-th GPU of a node sits on the
    k-th GPU index Slurm gave that job there (CUDA_VISIBLE_DEVICES order).
  * the local backend (`build_local`): no Slurm, so the nodes are the simulated ones our
    database knows, each with its job's GPUs per node.

Fragmentation, over usable nodes (not down, drained or reserved):
  free GPUs      idle GPUs;
  stranded GPUs  idle GPUs on nodes where some GPU is in use (no whole-node job can use them);
  free nodes     nodes with every GPU idle; largest free block: the longest run of them in
                 Slurm's node order (consecutive names are what a topology-aware request gets);
  index          stranded / free GPUs: 0 when every free GPU sits on a whole free node, 1 when
                 none does (0 when nothing is free).

"Shrink to MIN" says what Slurm would really hand back: it keeps the nodes the launcher keeps and
releases them by the launcher's own pure rules (launcher.backends.slurm.holdings: keep_rank,
plan_release; no torch, no Slurm calls), so a node Slurm refuses to release -- one of a heterogeneous
job's leader component, or a component's batch host while the component keeps other nodes -- is
shown as staying allocated (idle), never as freed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from db.records import Fragmentation, RankEntry
from launcher.backends.slurm.holdings import (
    COMPANION,
    COMPONENT,
    JOB,
    LEADER,
    Holder,
    holder_of,
    keep_rank,
    plan_release,
)

#: Node flags that make a node unusable for new work, and the mark the page shows for each.
UNUSABLE_FLAGS = {"DRAIN": "drained", "DRAINED": "drained", "DRAINING": "draining", "RESERVED": "reserved",
                  "MAINTENANCE": "maintenance", "NOT_RESPONDING": "not responding", "FAIL": "failing"}
UNUSABLE_STATES = {"down": "down", "drained": "drained", "draining": "draining", "fail": "failing",
                   "future": "future", "unknown": "unknown", "reserved": "reserved", "maint": "maintenance"}


@dataclass(frozen=True)
class ElasticJob:
    """What the database knows about one running elastic job."""

    id: int
    name: str
    slurm_job_id: str | None
    layout: str
    gpus_per_node: int
    pinned_node: str | None
    min_nodes: int
    entries: tuple[RankEntry, ...]
    held_nodes: tuple[str, ...] = ()  # nodes the job holds (ranks or not), in its own order
    node_gpus: Mapping[str, int] = field(default_factory=dict)  # node -> its GPUs (uneven nodes; else gpus_per_node)
    components: Mapping[str, int] = field(default_factory=dict)  # node -> het-job component (0: a plain job)
    owner: str = ""  # the Unix user whose launcher created it ("" where it predates owners)

    def gpus_on(self, node: str) -> int:
        return self.node_gpus.get(node) or self.gpus_per_node

    def component_of(self, node: str) -> int:
        """The node's component: as recorded for the node, else as its ranks say."""
        if node in self.components:
            return self.components[node]
        return next((e.component for e in self.entries if e.node == node), 0)

    @property
    def heterogeneous(self) -> bool:
        return any(self.components.values()) or any(e.component for e in self.entries)


@dataclass(frozen=True)
class GpuCell:
    index: int
    # idle | elastic (an elastic rank) | held (an elastic job's GPU without a rank) | job (non-elastic) | other
    # (another user's job, where the site keeps jobs private: dashboard.cluster_privacy)
    kind: str
    job: str = ""  # Slurm job id (or our job name on the local backend)
    job_name: str = ""
    elastic_id: int | None = None
    rank: int | None = None
    pp: int | None = None
    tp: int | None = None
    dp: int | None = None
    layout: str = ""
    user: str = ""  # whose job holds the GPU: Slurm's user name, or the elastic job's owner on the local view


@dataclass(frozen=True)
class NodeView:
    name: str
    state: str
    marks: tuple[str, ...]
    gpus: tuple[GpuCell, ...]
    partitions: tuple[str, ...] = ()
    reason: str = ""
    components: tuple[tuple[str, int], ...] = ()  # (job, component) for each heterogeneous job on the node

    @property
    def usable(self) -> bool:
        return not self.marks

    @property
    def used(self) -> int:
        return sum(1 for g in self.gpus if g.kind != "idle")

    @property
    def idle(self) -> int:
        return len(self.gpus) - self.used

    @property
    def stranded(self) -> int:
        """Idle GPUs a whole-node request cannot use because something else runs here."""
        return self.idle if self.usable and self.used else 0

    @property
    def whole_free(self) -> bool:
        return self.usable and self.used == 0 and bool(self.gpus)


@dataclass(frozen=True)
class ShrinkGain:
    """What shrinking one elastic job to its MIN node count would hand back."""

    job_id: int
    name: str
    held: tuple[str, ...]
    min_nodes: int
    released: tuple[str, ...]  # nodes Slurm would take back
    gpus_freed: int
    whole_nodes: tuple[str, ...]  # released nodes that would then be entirely free
    stays: tuple[str, ...] = ()  # nodes left without ranks that Slurm would not take back (allocated, idle)
    notes: tuple[str, ...] = ()  # why, per Slurm job or component (the launcher's own notes)


@dataclass(frozen=True)
class ClusterView:
    source: str  # slurm | local
    nodes: tuple[NodeView, ...]
    fragmentation: Fragmentation
    shrink: tuple[ShrinkGain, ...]
    jobs: Mapping[str, str] = field(default_factory=dict)  # job key -> label for the legend
    # elastic job id -> the Slurm jobs holding its nodes, as Slurm listed them (none on the local view)
    holders: Mapping[int, tuple[Holder, ...]] = field(default_factory=dict)

    @property
    def gpus_per_node(self) -> int:
        return max((len(n.gpus) for n in self.nodes), default=0)


# ---------------------------------------------------------------------------------- figures
def fragmentation(nodes: Sequence[NodeView]) -> Fragmentation:
    """Cluster-wide figures over usable nodes (see the module docstring for the definitions)."""
    usable = [n for n in nodes if n.usable]
    free = sum(n.idle for n in usable)
    stranded = sum(n.stranded for n in usable)
    run = best = 0
    for n in nodes:
        run = run + 1 if n.whole_free else 0
        best = max(best, run)
    return Fragmentation(gpus_total=sum(len(n.gpus) for n in nodes), gpus_free=free, stranded=stranded,
                         free_nodes=sum(1 for n in usable if n.whole_free), largest_free_block=best,
                         index=round(stranded / free, 4) if free else 0.0)


def shrink_gains(nodes: Sequence[NodeView], jobs: Sequence[ElasticJob],
                 holders: Mapping[int, Sequence[Holder]] | None = None) -> list[ShrinkGain]:
    """Per elastic job: the nodes a shrink to MIN keeps -- the launcher's order over the nodes it runs
    on: the pinned batch node, then holdings.keep_rank (a plain job's or a leader component's
    nodes, then batch hosts of components and companions), then most ranks, then node order -- and
    what the others free as Slurm allows (holdings.plan_release over `holders`, the Slurm jobs
    holding each job's nodes; default: job_holders): the job's GPUs on released nodes, which of them
    end up wholly free, and the nodes that stay allocated, idle."""
    order = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    out = []
    for job in jobs:
        mine = {n.name: [g for g in n.gpus if g.elastic_id == job.id] for n in nodes}
        held = [n for n in sorted(mine, key=lambda x: order[x]) if mine[n]]
        ranks = {n: sum(1 for g in cells if g.kind == "elastic") for n, cells in mine.items()}
        hs = list((holders or {}).get(job.id) or job_holders(job, held))
        running = [n for n in held if ranks[n] or n == job.pinned_node]  # idle held nodes are not kept
        keep = sorted(running, key=lambda n: (n != job.pinned_node, keep_rank(holder_of(hs, n), n), -ranks[n],
                                              order[n]))[:max(job.min_nodes, 1)]
        plan = plan_release(hs, keep, frozenset(n for n in held if n not in running))
        stays = tuple(n for n in held if n not in keep and n in plan.idle)
        released = tuple(n for n in held if n not in keep and n not in stays)
        whole = tuple(n for n in released if by_name[n].usable and by_name[n].used == len(mine[n]))
        out.append(ShrinkGain(job.id, job.name, tuple(held), job.min_nodes, released,
                              sum(len(mine[n]) for n in released), whole, stays, plan.notes))
    return out


def job_holders(job: ElasticJob, held: Sequence[str]) -> list[Holder]:
    """The Slurm jobs holding `held`, as far as our database knows without Slurm: a heterogeneous job's
    components (component 0, the leader, has the pinned batch node; another component's batch host is
    taken to be its first node, where Slurm runs it), else one plain job with the pinned batch node. Their
    Slurm job ids are not known here: 0, which the notes leave out."""
    if not job.heterogeneous:
        return [Holder(0, JOB, tuple(held), job.pinned_node)]
    comps: dict[int, list[str]] = {}
    for n in held:
        comps.setdefault(job.component_of(n), []).append(n)
    return [Holder(0, LEADER if c == 0 else COMPONENT, tuple(ns), job.pinned_node if c == 0 else _natural(ns)[0],
                   component=c) for c, ns in sorted(comps.items())]


def slurm_holder(sj, owner: ElasticJob, nodes: Sequence[str]) -> Holder:
    """The Holder of Slurm job record `sj` (dashboard.slurm_reader.SlurmJob) that belongs to elastic job
    `owner`: a component of a heterogeneous job (leader: offset 0), the job itself, or a companion."""
    if sj.het_job_id:
        kind = LEADER if sj.het_job_offset == 0 else COMPONENT
    else:
        kind = JOB if sj.job_id == owner.slurm_job_id else COMPANION
    return Holder(int(sj.job_id) if sj.job_id.isdigit() else 0, kind, tuple(nodes), sj.batch_host or None, sj.partition,
                  sj.het_job_offset if sj.het_job_id else None)


# ---------------------------------------------------------------------------------- builders
def node_marks(state: str, flags: Iterable[str], reserved: bool) -> tuple[str, ...]:
    """Why a node takes no new work: down, drained/draining, reserved, ... (empty: usable)."""
    marks = []
    base = state.lower().rstrip("*~#!%$@^-+")
    if base in UNUSABLE_STATES:
        marks.append(UNUSABLE_STATES[base])
    for f in flags:
        mark = UNUSABLE_FLAGS.get(f.upper())
        if mark == "drained" and base in ("allocated", "mixed", "completing"):
            mark = "draining"  # DRAIN on a busy node: it drains as its jobs end
        if mark:
            marks.append(mark)
    if reserved:
        marks.append("reserved")
    return tuple(dict.fromkeys(marks))


def _rank_cell(index: int, job_key: str, job: ElasticJob, e: RankEntry, user: str) -> GpuCell:
    return GpuCell(index, "elastic", job_key, job.name, job.id, e.virtual_rank, e.pp, e.tp, e.dp, job.layout, user)


def elastic_owner(slurm_id: str, slurm_name: str, jobs: Sequence[ElasticJob],
                  het_job_id: str = "") -> ElasticJob | None:
    """The elastic job a Slurm job belongs to: its own allocation (any component of a heterogeneous
    one: `het_job_id` is the leader's id) or one of its companion jobs."""
    for job in jobs:
        if job.slurm_job_id and job.slurm_job_id in (slurm_id, het_job_id):
            return job
        if re.fullmatch(re.escape(job.name) + r"-companion-\d+", slurm_name or ""):
            return job
    return None


def build_from_slurm(snapshot, jobs: Sequence[ElasticJob], partitions: Iterable[str] = ()) -> ClusterView:
    """The view from a `dashboard.slurm_reader.SlurmSnapshot` plus the elastic jobs in our database."""
    wanted = set(partitions)
    reserved = snapshot.reserved_nodes
    cells: dict[str, dict[int, GpuCell]] = {}
    labels: dict[str, str] = {}
    holders: dict[int, list[Holder]] = {}  # elastic job -> the Slurm jobs holding its nodes
    marks: dict[str, list[tuple[str, int]]] = {}
    for sj in snapshot.jobs:
        owner = elastic_owner(sj.job_id, sj.name, jobs, sj.het_job_id)
        labels[sj.job_id] = f"{sj.job_id} {sj.name}" + (" (elastic)" if owner else "")
        if sj.het_job_id:  # Slurm says which component holds the node (its HetJobOffset)
            for node in [*sj.gpus, *sj.gpus_unknown]:
                marks.setdefault(node, []).append((owner.name if owner else f"job {sj.het_job_id}", sj.het_job_offset))
        nodes = {**{n: idx for n, idx in sj.gpus.items()},
                 **{n: tuple(range(c)) for n, c in sj.gpus_unknown.items() if n not in sj.gpus}}
        if owner is not None:
            holders.setdefault(owner.id, []).append(slurm_holder(sj, owner, list(nodes)))
        for node, idx in nodes.items():
            ranks = {e.gpu: e for e in owner.entries if e.node == node} if owner else {}
            for k, gpu in enumerate(idx):
                if owner is None:
                    cell = GpuCell(gpu, "job", sj.job_id, sj.name, user=sj.user)
                elif k in ranks:
                    cell = _rank_cell(gpu, sj.job_id, owner, ranks[k], sj.user)
                else:
                    cell = GpuCell(gpu, "held", sj.job_id, owner.name, owner.id, layout=owner.layout, user=sj.user)
                cells.setdefault(node, {})[gpu] = cell
    views = []
    for n in snapshot.nodes:
        if wanted and not wanted & set(n.partitions):
            continue
        mine = cells.get(n.name, {})
        width = max([n.gpus] + [g + 1 for g in mine])
        gpus = tuple(mine.get(g, GpuCell(g, "idle")) for g in range(width))
        views.append(NodeView(n.name, n.state, node_marks(n.state, n.flags, n.name in reserved), gpus,
                              n.partitions, n.reason, tuple(marks.get(n.name, ()))))
    elastic_here = [j for j in jobs if any(g.elastic_id == j.id for v in views for g in v.gpus)]
    return ClusterView("slurm", tuple(views), fragmentation(views), tuple(shrink_gains(views, elastic_here, holders)),
                       labels, {k: tuple(v) for k, v in holders.items()})


def build_local(jobs: Sequence[ElasticJob], failed_nodes: Iterable[str] = ()) -> ClusterView:
    """The local backend's simulated nodes, from the database alone: every node a running job
    holds or runs on, with the GPUs that job recorded for it (uneven nodes differ). A node a job
    holds without running a rank there (its pinned batch node, a node not yet released) shows that
    job's GPUs as `held`; on a node where it runs ranks, its other GPUs are idle (stranded)."""
    failed = set(failed_nodes)
    names: list[str] = []
    width: dict[str, int] = {}
    cells: dict[str, dict[int, GpuCell]] = {}
    labels: dict[str, str] = {}
    marks: dict[str, list[tuple[str, int]]] = {}
    for job in jobs:
        key = f"job-{job.id}"
        labels[key] = f"{job.name} (elastic)"
        ranks = {(e.node, e.gpu): e for e in job.entries}
        nodes = list(dict.fromkeys([*job.held_nodes, *(e.node for e in job.entries)]))
        for node in nodes:
            if node not in width:
                names.append(node)
            width[node] = max(width.get(node, 0), job.gpus_on(node), *(g + 1 for n, g in ranks if n == node))
            if job.heterogeneous:
                marks.setdefault(node, []).append((job.name, job.component_of(node)))
            here = cells.setdefault(node, {})
            for gpu in range(job.gpus_on(node)):
                e = ranks.get((node, gpu))
                if e is not None:
                    here[gpu] = _rank_cell(gpu, key, job, e, job.owner)
                elif gpu not in here and node in job.held_nodes and not any(n == node for n, _ in ranks):
                    here[gpu] = GpuCell(gpu, "held", key, job.name, job.id, layout=job.layout, user=job.owner)
    views = [NodeView(n, "down" if n in failed else "up", ("down",) if n in failed else (),
                      tuple(cells[n].get(g, GpuCell(g, "idle")) for g in range(width[n])),
                      components=tuple(marks.get(n, ())))
             for n in _natural(names)]
    return ClusterView("local", tuple(views), fragmentation(views), tuple(shrink_gains(views, jobs)), labels)


def _natural(names: Sequence[str]) -> list[str]:
    """node2 before node10."""
    return sorted(names, key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)])
