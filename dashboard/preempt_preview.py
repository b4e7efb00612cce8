"""Dry run of a preempt picked on the cluster view: which elastic jobs would migrate off the picked
nodes, to which layout, and how many bytes the planner would move. It calls the planner
(migrate.plan, pure: no processes) on what the launcher recorded (the job's launch spec: model, node
range, layout per size), never the launcher itself, and changes nothing.

The nodes it says a preempt releases are those Slurm would take back: the launcher gives them back
through launcher.backends.slurm.holdings.plan_release, and so does the preview, over the Slurm jobs
holding the job's nodes (as Slurm lists them, else as the database's het-job components say), so a
node of a heterogeneous job's leader component, which Slurm cannot resize, is shown as staying
allocated, idle, with the reason -- as /cluster's "shrink to MIN" panel shows it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from dashboard.cluster import ClusterView, ElasticJob, job_holders
from launcher.backends.slurm.holdings import Holder, plan_release


@dataclass(frozen=True)
class JobPreview:
    job_id: int
    name: str
    leaving: tuple[str, ...]  # picked nodes the job holds
    keep: tuple[str, ...]
    from_layout: str
    to_layout: str = ""
    bytes_moved: int | None = None  # None: the job's own model, which only its launcher plans
    bytes_checkpoint: int | None = None
    nodes_released: tuple[str, ...] = ()  # picked nodes Slurm would take back
    stays: tuple[str, ...] = ()  # picked nodes left without ranks that Slurm would not take back (allocated, idle)
    notes: tuple[str, ...] = ()  # why, per Slurm job or component (the launcher's own release notes)
    refused: str = ""  # why it cannot go (the request validation's reason, no layout, no plan), "" if it can


@dataclass(frozen=True)
class Preview:
    nodes: tuple[str, ...]
    jobs: tuple[JobPreview, ...]
    others: tuple[tuple[str, str, str], ...]  # (node, Slurm job, name) of non-elastic jobs that stay


def job_nodes(job: ElasticJob) -> list[str]:
    """The nodes the job runs ranks on, in rank order (what the job page's preempt accepts)."""
    return list(dict.fromkeys(e.node for e in job.entries))


def preview_job(job: ElasticJob, spec: Mapping[str, Any] | None, picked: set[str],
                validate: Callable[[ElasticJob, list[str]], str | None],
                holders: Sequence[Holder] | None = None) -> JobPreview:
    """What preempting `picked` would do to one job. `validate(job, leaving)` is the admin-request
    validation the confirm goes through (db.requests): its refusal, if any, is the preview's; then
    the layout the job's policy picks for the devices left, the planner's plan for it, and what
    Slurm would take back of the nodes it leaves (`holders`: the Slurm jobs holding the job's nodes;
    default: dashboard.cluster.job_holders, from the database)."""
    from migrate.layout import LayoutError, ModelSpec, ParallelConfig
    from migrate.plan import plan
    from migrate.topology import Device, RankMap, Topology

    held = job_nodes(job)
    leaving = tuple(n for n in held if n in picked)
    keep = tuple(n for n in held if n not in picked)
    base = JobPreview(job.id, job.name, leaving, keep, job.layout)

    def refuse(why: str) -> JobPreview:
        return JobPreview(**{**base.__dict__, "refused": why})

    why = validate(job, list(leaving))
    if why:
        return refuse(why)
    if not spec:
        return refuse("no launch spec recorded for this job (launched by an older launcher): no dry run")
    devices = sum(job.gpus_on(n) for n in keep)  # nodes may differ (uneven nodes)
    target = (spec.get("layouts") or {}).get(str(devices))
    if not target:
        return refuse(f"the job's policy has no layout for {devices} devices")
    stays, notes = slurm_keeps(job, leaving, holders)
    staying = tuple(n for n in leaving if n in stays)
    if not spec.get("model"):  # the script's own model (runtime API): its launcher plans the bytes, not this
        return JobPreview(job.id, job.name, leaving, keep, job.layout, target, None, None,
                          tuple(n for n in leaving if n not in stays), staying, notes)
    topo = Topology(tuple(Device(i, n, g) for i, (n, g) in
                          enumerate((n, g) for n in held for g in range(job.gpus_on(n)))), frozenset(keep))
    index = {(d.node, d.gpu): d.id for d in topo.devices}
    try:
        prev = RankMap(ParallelConfig.parse(job.layout),
                       tuple(index[(e.node, e.gpu)] for e in sorted(job.entries, key=lambda e: e.virtual_rank)))
        p = plan(ModelSpec(**spec["model"]), prev, ParallelConfig.parse(target), topo)
    except (LayoutError, KeyError) as exc:
        return refuse(f"the planner cannot plan it: {exc}")
    return JobPreview(job.id, job.name, leaving, keep, job.layout, str(p.curr.layout), p.bytes_moved,
                      p.bytes_checkpoint, tuple(n for n in p.nodes_released if n not in stays), staying, notes)


def slurm_keeps(job: ElasticJob, leaving: Sequence[str], holders: Sequence[Holder] | None) -> tuple[set[str], tuple[str, ...]]:
    """(nodes of `leaving` Slurm would not take back, the release notes): the launcher's release after the
    move (launcher.loop.outcome.release_departed) keeps every held node but those left, and nodes held
    without ranks are already idle."""
    held = list(dict.fromkeys([*job.held_nodes, *job_nodes(job)]))
    ranked = set(job_nodes(job))
    hs = list(holders) if holders else job_holders(job, held)
    plan = plan_release(hs, [n for n in held if n not in leaving], frozenset(n for n in held if n not in ranked))
    return set(plan.idle) & set(leaving), plan.notes


def preview(view: ClusterView, jobs: Sequence[ElasticJob], specs: Mapping[int, Mapping[str, Any] | None],
            picked: Sequence[str], validate: Callable[[ElasticJob, list[str]], str | None]) -> Preview:
    """The dry run over every elastic job holding a picked node; non-elastic jobs are listed as staying.
    ValueError for a node the cluster does not have."""
    names = {n.name for n in view.nodes}
    unknown = [n for n in picked if n not in names]
    if unknown:
        raise ValueError(f"no node {', '.join(unknown)} in the cluster")
    if not picked:
        raise ValueError("pick at least one node")
    chosen = set(picked)
    previews = tuple(preview_job(j, specs.get(j.id), chosen, validate, view.holders.get(j.id))
                     for j in jobs if chosen & set(job_nodes(j)))
    others = tuple(dict.fromkeys((n.name, g.job, g.job_name) for n in view.nodes if n.name in chosen
                                 for g in n.gpus if g.kind == "job"))
    return Preview(tuple(n for n in (x.name for x in view.nodes) if n in chosen), previews, others)
