"""Several elastic jobs on one partition: who grows into the idle nodes, who yields to a pending job.

Why: each launcher decides alone (no daemon, no shared database: two jobs may write to different
histories), and each sees the same queue. Left to themselves, every elastic job would grow onto the same
idle nodes (Slurm gives them to one; the others' companion jobs wait, or take nodes a plain job needed)
and every one would yield for the same pending job (giving back N times what it lacks). So the jobs mark
themselves in Slurm, where every user can read them (`squeue`'s comment field: the policy and its node
range on the job, `companion-of=<job>` on each companion job), and every launcher computes the same split
from the same view, in an order every one of them agrees on:

  yield  lowest Slurm priority first, then the newest (latest submitted), then the highest job id: each job
         gives back what it holds above its --nnodes minimum until the pending job's shortfall is made up;
         nobody yields when all of them together cannot make it up (the job would wait anyway);
  grow   highest priority first, then the oldest, then the lowest job id: each job takes what it has room
         for below its maximum until the idle nodes are shared out.

Views taken a few seconds apart can disagree for one look; the next look, with the resizes done, agrees.
Pure: the launcher reads the marks (launcher.backends.slurm.health.partition_view) and passes them here.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MARK = "elastic-launch"  # the first word of every comment this product sets


@dataclass(frozen=True)
class Peer:
    """An elastic job with --policy opportunistic in the partition (the deciding job among them)."""

    job_id: int
    nodes: int  # held now, its companion jobs' included
    min_nodes: int
    max_nodes: int
    priority: int = 0
    submit_time: int = 0

    @property
    def above_min(self) -> int:
        return max(0, self.nodes - self.min_nodes)

    @property
    def room(self) -> int:
        return max(0, self.max_nodes - self.nodes)


def policy_mark(policy: str, min_nodes: int, max_nodes: int) -> str:
    """The comment of an elastic job's own Slurm job: its policy and node range."""
    return f"{MARK} policy={policy} min={min_nodes} max={max_nodes}"


def companion_mark(main_job_id: int | str) -> str:
    """The comment of a companion job: whose nodes it holds."""
    return f"{MARK} companion-of={main_job_id}"


def read_mark(comment: str | None) -> dict[str, str]:
    """key -> value of a comment this product set; {} for any other comment."""
    words = (comment or "").split()
    if not words or words[0] != MARK:
        return {}
    return dict(w.split("=", 1) for w in words[1:] if "=" in w)


def companion_owner(comment: str | None) -> int | None:
    """The main job a companion job holds nodes for (None: not a companion)."""
    owner = read_mark(comment).get("companion-of", "")
    return int(owner) if owner.isdigit() else None


def peers_of(jobs: Iterable) -> tuple[Peer, ...]:
    """The running opportunistic elastic jobs among `jobs` (slurm JobInfo-like: job_id, state, num_nodes,
    comment, priority, submit_time), each with its running companions' nodes counted in."""
    jobs = list(jobs)
    extra: dict[int, int] = {}
    for j in jobs:
        owner = companion_owner(j.comment)
        if owner is not None and j.state == "RUNNING":
            extra[owner] = extra.get(owner, 0) + j.num_nodes
    peers = []
    for j in jobs:
        mark = read_mark(j.comment)
        if j.state != "RUNNING" or mark.get("policy") != "opportunistic":
            continue
        try:
            lo, hi = int(mark["min"]), int(mark["max"])
        except (KeyError, ValueError):
            continue  # a mark this version cannot read: that job is left out of the split
        peers.append(Peer(j.job_id, j.num_nodes + extra.get(j.job_id, 0), lo, hi, j.priority, j.submit_time))
    return tuple(peers)


def yield_order(peers: Sequence[Peer]) -> list[Peer]:
    return sorted(peers, key=lambda p: (p.priority, -p.submit_time, -p.job_id))


def grow_order(peers: Sequence[Peer]) -> list[Peer]:
    return sorted(peers, key=lambda p: (-p.priority, p.submit_time, p.job_id))


def yield_share(me: int, peers: Sequence[Peer], short: int) -> int:
    """Nodes job `me` gives back so that `short` more nodes become free (0 where others give them, or where
    all the peers together cannot)."""
    if short <= 0 or sum(p.above_min for p in peers) < short:
        return 0
    return _share_of(me, [(p.job_id, p.above_min) for p in yield_order(peers)], short)


def grow_share(me: int, peers: Sequence[Peer], idle: int) -> int:
    """Of `idle` idle nodes, how many job `me` grows onto."""
    return _share_of(me, [(p.job_id, p.room) for p in grow_order(peers)], idle)


def _share_of(me: int, wants: Sequence[tuple[int, int]], amount: int) -> int:
    """`amount` handed out in order, each (job, most it takes) as much as it can: what `me` gets."""
    for job, most in wants:
        take = min(most, amount)
        if job == me:
            return take
        amount -= take
    return 0
