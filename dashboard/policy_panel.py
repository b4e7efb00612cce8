"""/cluster's policy panels: what each elastic job's resize policy holds, watches and decided.

Why a module of its own: the cluster view (dashboard.cluster) is Slurm's picture of nodes and GPUs; the policy
is the launcher's, told through the job's record (db.store_policy: the policy in force and its last look) and
the migrations it caused (trigger `policy`). This joins the two: the nodes an opportunistic job holds above
its MIN are the ones a shrink to MIN would hand back (ShrinkGain.released), the ones it would yield first.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dashboard.cluster import ClusterView
from dashboard.cluster_data import elastic_jobs

if TYPE_CHECKING:
    from db.store import Store

DECISIONS_SHOWN = 20


@dataclass(frozen=True)
class PolicyRow:
    """One running elastic job as its policy sees it."""

    job_id: int
    name: str
    policy: str
    held: int
    min_nodes: int
    above_min: tuple[str, ...]  # held opportunistically: what it would give back first (opportunistic only)
    watching: tuple[str, ...]  # the pending jobs of its last look, in the order it takes them
    idle: tuple[str, ...]  # the idle nodes of its last look
    decision: str | None  # what its last look decided (None: nothing to do)
    looked_at: str | None  # when (ISO, UTC), None: no look yet


def _pending_text(p: dict[str, Any]) -> str:
    return f"#{p.get('job_id')} {p.get('name', '')}: {p.get('nodes')} node(s) ({p.get('reason', '')})"


def policy_rows(store: "Store", view: ClusterView) -> list[PolicyRow]:
    released = {s.job_id: s.released for s in view.shrink}
    records = {j.id: j for j in store.list_jobs()}  # one query: each job's policy and last look
    rows = []
    for job in elastic_jobs(store):
        record = records.get(job.id)
        if record is None:
            continue
        watch = (record.policy_watch or {}) if record.policy == "opportunistic" else {}
        decision = watch.get("decision") or None
        rows.append(PolicyRow(
            job.id, job.name, record.policy, len(job.held_nodes), job.min_nodes,
            released.get(job.id, ()) if record.policy == "opportunistic" else (),
            tuple(_pending_text(p) for p in watch.get("pending", ())), tuple(watch.get("idle", ())),
            None if decision is None else f"to {decision['nodes']} node(s): {decision['reason']}",
            watch.get("at")))
    return rows


def opportunistic_nodes(rows: Sequence[PolicyRow]) -> dict[str, str]:
    """node -> the job that holds it above its MIN on the opportunistic policy (the grid's badge)."""
    return {n: r.name for r in rows for n in r.above_min}


def policy_decisions(store: "Store", owner: str | None = None) -> list[dict[str, Any]]:
    """The policy's resizes across every job (of `owner`'s only, when given), newest first (history rows:
    trigger `policy`, the reason in their notes)."""
    return store.history(trigger="policy", limit=DECISIONS_SHOWN, owner=owner)
