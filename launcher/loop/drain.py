"""Nodes the cluster drains are left by a live shrink, with nothing lost, instead of held to the job's end.

Why: an admin drains a node (`scontrol update nodename=n3 state=drain reason=...`) to take it out of
service once its jobs end; a plain job keeps it until it finishes, hours later. An elastic job can leave it
within seconds by moving its state off it: every WATCH_S the backend is asked which of the job's nodes
drain, and those the job can spare (not the batch node, and the job keeps its --nnodes minimum) are left in
one live shrink (trigger `preempt`, noted as drained by the cluster). A node it cannot spare is said once.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

WATCH_S = 30.0  # how often the backend is asked which of the job's nodes drain (a drain waits for jobs to end)


class DrainWatch:
    """Which of the job's nodes to leave because the cluster drains them (pure but for the backend's answer)."""

    def __init__(self, draining: Callable[[Sequence[str]], dict[str, str]], log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.draining, self.log, self.clock = draining, log, clock
        self.watched = float("-inf")
        self.kept: set[str] = set()  # draining nodes the job could not spare, said once

    def due(self, active: Sequence[str], min_nodes: int, batch: str | None) -> dict[str, str]:
        """node -> what the cluster says of it, for the nodes to leave now ({} on most polls)."""
        now = self.clock()
        if now - self.watched < WATCH_S or not active:
            return {}
        self.watched = now
        said = self.draining(list(active))
        leave: dict[str, str] = {}
        room = len(active) - min_nodes
        for node in active:
            if node not in said:
                continue
            why = "it runs the batch step" if node == batch else \
                f"the job is at its minimum of {min_nodes} node(s)" if len(leave) >= room else None
            if why is None:
                leave[node] = said[node]
            elif node not in self.kept:
                self.kept.add(node)
                self.log(f"{node} is drained by the cluster ({said[node]}), but the job keeps it: {why}")
        return leave
