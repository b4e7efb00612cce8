"""Elastic by itself: grow into nodes the cluster leaves idle, give them back when queued work needs them.

Why: a job that changes size only when a person asks holds what it started with; on a shared cluster the
point of an elastic job is to fill the holes the scheduler leaves and to yield them when a plain job can
use them, with nobody in the loop and nothing lost (the Singularity paper's premise). The launcher looks at
the cluster every few seconds (the job's partition: its idle nodes, the jobs pending there for resources,
in Slurm's priority order) and this decides, purely:

  yield  the first job pending for resources needs more nodes than are idle, and this job holds enough above
         its --nnodes minimum to make up the difference: shrink by exactly that (at once: work waits);
  grow   no job is pending for resources, nodes have stayed idle for `idle_s`, and this job is below its
         maximum: grow onto them.

Against thrashing: a grow waits `dwell_s` after any resize, and at most `max_per_hour` policy resizes
happen in any hour (yields included). Each decision says why, for the history, the audit log and the log.
With other opportunistic elastic jobs in the partition, the idle nodes and the yield are split between them
the same way by each (launcher.policy.peers).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from launcher.policy.peers import Peer, companion_owner, grow_share, peers_of, yield_share

WAITING_REASONS = ("Resources", "Priority")  # squeue's reasons of a job that would start on free nodes


@dataclass(frozen=True)
class Pending:
    """A job waiting in the queue of the elastic job's partition."""

    job_id: int
    name: str
    nodes: int
    reason: str


@dataclass(frozen=True)
class ClusterView:
    """What the cluster says now: the partition's idle nodes, its pending jobs in priority order, and the
    opportunistic elastic jobs running there (this one among them where Slurm has its mark)."""

    idle: tuple[str, ...]
    pending: tuple[Pending, ...] = ()
    peers: tuple[Peer, ...] = ()


@dataclass(frozen=True)
class Decision:
    nodes: int  # the node count to resize to
    reason: str


class OpportunisticPolicy:
    """One job's policy state (last resize, resizes this hour, since when nodes are idle)."""

    def __init__(self, min_nodes: int, max_nodes: int, idle_s: float = 30.0, dwell_s: float = 60.0,
                 max_per_hour: int = 12, clock: Callable[[], float] = time.monotonic, me: int = 0) -> None:
        self.min_nodes, self.max_nodes, self.me = min_nodes, max_nodes, me  # me: this job's Slurm id
        self.idle_s, self.dwell_s, self.max_per_hour, self.clock = idle_s, dwell_s, max_per_hour, clock
        self.idle_since: float | None = None
        self.resizes: list[float] = []  # when each policy resize was decided

    def decide(self, held: int, view: ClusterView) -> Decision | None:
        now = self.clock()
        self.resizes = [t for t in self.resizes if now - t < 3600]
        if not view.idle:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        if len(self.resizes) >= self.max_per_hour:
            return None
        waiting = [p for p in view.pending if p.reason in WAITING_REASONS]
        peers = self._peers(held, view)
        if waiting:
            return self._made(now, self._yield(held, waiting[0], len(view.idle), peers))
        if (view.idle and held < self.max_nodes and now - self.idle_since >= self.idle_s
                and (not self.resizes or now - self.resizes[-1] >= self.dwell_s)):
            share = grow_share(self.me, peers, len(view.idle))
            if share <= 0:
                return None  # elastic jobs ahead of this one take them
            return self._made(now, Decision(held + share, f"{len(view.idle)} node(s) idle for "
                                                          f"{now - self.idle_since:.0f} s ({', '.join(view.idle)}) "
                                                          f"and no job pending for them{_sharing(peers, share)}"))
        return None

    def _peers(self, held: int, view: ClusterView) -> list[Peer]:
        """The opportunistic elastic jobs of the partition, this one with what its launcher holds now."""
        mine = [p for p in view.peers if p.job_id == self.me]
        order = (mine[0].priority, mine[0].submit_time) if mine else (0, 0)
        return [Peer(self.me, held, self.min_nodes, self.max_nodes, *order),
                *(p for p in view.peers if p.job_id != self.me)]

    def _yield(self, held: int, first: Pending, idle: int, peers: list[Peer]) -> Decision | None:
        short = first.nodes - idle
        give = yield_share(self.me, peers, short)
        if give <= 0:
            return None  # it starts on the idle nodes, others give them, or all together cannot make up the difference
        return Decision(held - give, f"job {first.job_id} ({first.name}) pending for {first.nodes} node(s) "
                                     f"({first.reason}), {idle} idle: giving {give} back{_sharing(peers, give)}")

    def _made(self, now: float, decision: Decision | None) -> Decision | None:
        if decision is not None:
            self.resizes.append(now)
        return decision


def _sharing(peers: list[Peer], mine: int) -> str:
    if len(peers) < 2:
        return ""
    return f" ({len(peers) - 1} other elastic job(s) in the partition; this one's share: {mine})"


def pending_view(idle: Sequence[str], jobs: Sequence, own: Sequence[int] = ()) -> ClusterView:
    """A ClusterView from the partition's idle nodes and its jobs (slurm JobInfo-like: state, reason, comment,
    priority, submit_time, ...), pending ones in the order Slurm starts them: highest priority first, then the
    earliest submitted (the order given where Slurm reports neither). Left out of the pending: this job's own
    (`own`: itself, its companions) and any elastic job's companion (a grow waiting for its nodes is not work
    to yield to)."""
    jobs = list(jobs)
    waiting = [j for j in jobs if j.state == "PENDING" and j.job_id not in own and companion_owner(j.comment) is None]
    waiting.sort(key=lambda j: (-j.priority, j.submit_time))  # stable: equal keys keep squeue's order
    pending = tuple(Pending(j.job_id, j.name, max(j.num_nodes, 1), j.reason) for j in waiting)
    return ClusterView(tuple(idle), pending, peers_of(jobs))
