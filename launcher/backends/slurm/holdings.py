"""Which Slurm jobs hold the launcher's nodes, and what giving nodes back or asking for more means for each.

Pure (no Slurm calls): launcher.backends.slurm.nodes carries the answers out. A job's nodes are held by
one or more Slurm jobs, each a `Holder`: the launcher's plain job, the components of a
heterogeneous job (the leader, offset 0, and the others, each with its own job id), and the
companion jobs a grow submitted. Slurm 22.05 allows different things for each (the
guide's reference, docs/reference/slurm.md): a plain job, a non-leader component or a companion shrinks with
`scontrol update JobId=<its id> NodeList=...` but never loses its batch host; a non-leader
component or a companion goes as a whole with `scancel <its id>`; the leader component cannot be
resized at all. Where Slurm refuses, `plan_release` falls back to the nearest thing it allows --
the node stays allocated, idle (a later grow starts workers there again) -- and says so in a note
that ends up in the migration's history.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.backends.slurm.hostlist import compress_hostlist

JOB, LEADER, COMPONENT, COMPANION = "job", "leader", "component", "companion"


@dataclass(frozen=True)
class Holder:
    """One Slurm job holding nodes for the launcher.

    `job_id` is what `scontrol update`/`scancel` take (a component's own id); `step_job` and
    `het_group` what `srun --jobid= [--het-group=]` takes (a component's steps name the leader).
    `component` is the heterogeneous-job component the nodes count as (a companion: the one it
    extends; None for a plain job)."""

    job_id: int
    kind: str  # JOB, LEADER, COMPONENT or COMPANION
    nodes: tuple[str, ...]
    batch_host: str | None
    partition: str = ""
    component: int | None = None
    step_job: int | None = None  # None: job_id
    het_group: int | None = None

    @property
    def srun_job(self) -> int:
        return self.job_id if self.step_job is None else self.step_job

    @property
    def label(self) -> str:
        if self.kind == COMPANION:
            return f"companion job {self.job_id}"
        if self.component is not None:  # job id 0: not known (the dashboard's view without Slurm)
            return f"component {self.component}" + (f" (Slurm job {self.job_id})" if self.job_id else "")
        return f"Slurm job {self.job_id}" if self.job_id else "the job"


def holder_of(holders: Sequence[Holder], node: str) -> Holder | None:
    """The holder whose nodes include `node`, else None."""
    return next((h for h in holders if node in h.nodes), None)


def keep_rank(holder: Holder | None, node: str) -> int:
    """Order in which a shrink keeps nodes (lower first), so that it keeps what Slurm could not give back
    anyway: the nodes of a plain job or of a heterogeneous job's leader component (and nodes of no known
    holder) first, then the batch hosts of other components and companions (they go only with their
    whole job), then the rest. The launcher (SlurmNodes.keep_rank) and the dashboard's "shrink to MIN"
    panel both order by it."""
    if holder is None or holder.kind in (JOB, LEADER):
        return 0
    return 1 if node == holder.batch_host else 2


@dataclass(frozen=True)
class ReleasePlan:
    """What giving back the nodes outside `keep` runs: `shrink` (job id, nodes it keeps) with
    `scontrol update`, `cancel` job ids with `scancel`; `idle` nodes stay allocated (Slurm would not
    let them go); `notes` say what happened per component, for the migration's history."""

    shrink: tuple[tuple[int, tuple[str, ...]], ...] = ()
    cancel: tuple[int, ...] = ()
    idle: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def plan_release(holders: Sequence[Holder], keep: Sequence[str], idle: frozenset[str] = frozenset()) -> ReleasePlan:
    """Give back every held node not in `keep`, as far as Slurm allows; `idle` are nodes already left
    idle by an earlier fallback (not noted again)."""
    keep_set = set(keep)
    shrink, cancel, stay, notes = [], [], [], []
    for h in holders:
        kept = [n for n in h.nodes if n in keep_set]
        going = [n for n in h.nodes if n not in keep_set]
        if not going:
            continue
        het = h.component is not None
        if h.kind == LEADER:
            stay += going
            new = [n for n in going if n not in idle]
            if new:
                notes.append(f"{h.label}: Slurm cannot resize a heterogeneous job's leader component; "
                             f"{compress_hostlist(new)} stay{'s' if len(new) == 1 else ''} allocated, idle")
            continue
        if not kept and h.kind in (COMPONENT, COMPANION):
            cancel.append(h.job_id)
            if h.kind == COMPANION:
                notes.append(f"companion job {h.job_id} cancelled" + (f" (component {h.component})" if het else ""))
            else:
                notes.append(f"{h.label} cancelled: {compress_hostlist(going)} released")
            continue
        if h.batch_host and h.batch_host not in kept:  # only the whole job could give its batch host back
            kept = [h.batch_host] + kept
            going.remove(h.batch_host)
            stay.append(h.batch_host)
            if h.batch_host not in idle:
                notes.append(f"{h.label}: its batch host {h.batch_host} goes only with the whole job; "
                             "it stays allocated, idle")
        if going:
            shrink.append((h.job_id, tuple(kept)))
            if het:
                notes.append(f"{h.label}: {compress_hostlist(going)} released (scontrol update)")
    return ReleasePlan(tuple(shrink), tuple(cancel), tuple(stay), tuple(notes))


@dataclass(frozen=True)
class Shape:
    """What a companion job asks for: the partition and GPUs per node of the component it extends."""

    component: int | None
    partition: str
    gpus: int


def companion_shape(start: Sequence[Holder], now: Sequence[Holder], gpus: Mapping[str, int]) -> Shape:
    """The shape of the next companion job: like the component that lost the most nodes since the
    start (ties: the later component), else like the last one. GPUs per node: the fewest among the
    nodes it lost (among all its nodes when it lost none), so any node like them fits."""
    comps = [h for h in start if h.kind != COMPANION]
    if not comps:
        raise ValueError("companion_shape: no job or component to extend")

    def held(c: Holder) -> set[str]:
        return {n for h in now if h.component == c.component and (h.kind == COMPANION or h.job_id == c.job_id)
                for n in h.nodes}

    best = max(comps, key=lambda c: (len(c.nodes) - len(held(c)), -1 if c.component is None else c.component))
    lost = [n for n in best.nodes if n not in held(best)]
    return Shape(best.component, best.partition, min(gpus[n] for n in (lost or best.nodes)))
