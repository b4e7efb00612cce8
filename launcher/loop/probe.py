"""A collective failed and no worker is seen ending: is a whole node gone?

On the local backend a worker's end is seen at once. On Slurm a crashed node's step just goes quiet (its
slurmd, slurmstepd and tasks vanish together; srun waits), and Slurm itself notices only by its pings,
SlurmdTimeout later (30 s on the testbed, 300 s by default) -- while the survivors' collectives fail at
once ("Connection closed by peer"). Each survivor then posts a suspicion and waits for the launcher's
answer (launcher.runtime.faults.is_peer_failure), cutting its own sockets so that workers blocked on it
fail and post theirs too. Here the launcher answers:

1. announce the check (`probe/<world>` = the seconds it may take: the workers wait that long);
2. after SETTLE_S, the devices of the training world that posted nothing are the quiet ones: a worker
   that failed with its peers posts within a poll, a dead one never does. None quiet: every worker is
   alive and each failed on its own (a script error) -- answer "clear" (they raise it, as before);
3. ask the backend which of the quiet devices' nodes are gone (NodeBackend.unreachable: Slurm's node
   state, then a one-task step on each); those are returned to the launcher, which recovers as from
   any node loss (from the DP replicas, else the safety checkpoint);
4. nothing found gone within the backend's `probe_s`: answer "clear".

Besides, every WATCH_S the backend is asked for the cluster's own word on the world's nodes (Slurm: a node
DOWN or FAILing; missed pings alone count only in a check), without steps: a node that dies without cutting its peers'
connections (power lost) blocks them in their collective until its timeout, and Slurm may say so first.
"""
from __future__ import annotations

import time

SETTLE_S = 2.0  # after the first suspicion: the time survivors take to fail and post theirs
WATCH_S = 30.0  # how often the cluster's own view of the nodes is read while nothing is suspected (a few RPCs a
# minute; Slurm's own pings take SlurmdTimeout, 300 s by default, to call a node down)


class NodeProbe:
    """One launcher's check of the nodes, at most one per training world."""

    def __init__(self, backend, holder, holdings, log) -> None:
        """`holder.ctl`: the control plane (read at each call: the launcher connects it after making its mode)."""
        self.backend, self.holder, self.holdings, self.log = backend, holder, holdings, log
        self.world: str | None = None
        self.started: float | None = None
        self.done = False
        self.asked: set[str] = set()  # nodes the backend already found reachable in this check
        self.watched = float("-inf")  # when the backend was last asked about every node of the world

    @property
    def ctl(self):
        return self.holder.ctl

    def gone(self, world: str, devices: list[int]) -> dict[str, str]:
        """Nodes of `devices` (the training world's) found gone, with why; {} while nothing is (or nothing
        is suspected). Call once per poll while no worker is seen dead."""
        if world != self.world:
            self.world, self.started, self.done, self.asked = world, None, False, set()
        if self.done:
            return {}
        now = time.monotonic()
        if now - self.watched >= WATCH_S:  # the cluster's own word on the nodes, now and then
            self.watched = now
            said = self.backend.unreachable(list(dict.fromkeys(map(self.holdings.node_of, devices))), steps=False)
            if said:
                self.done = True
                return said
        if self.started is None:
            if not self.ctl.suspect_count(world):
                return {}
            self.started = now
            self.ctl.set_probe(world, str(self.backend.probe_s))
            self.log(f"a collective of {world} failed and no worker ended: checking the nodes "
                     f"(up to {self.backend.probe_s:.0f} s)")
            return {}
        if now - self.started < SETTLE_S:
            return {}
        said = set(self.ctl.suspected(world, devices))
        quiet = list(dict.fromkeys(self.holdings.node_of(d) for d in devices if d not in said))
        if not quiet:
            return self._clear(f"every worker of {world} is alive and reported its own error")
        found = self.backend.unreachable([n for n in quiet if n not in self.asked])
        if found:
            self.done = True
            return found
        self.asked |= set(quiet)
        if time.monotonic() - self.started > self.backend.probe_s:
            return self._clear(f"devices {sorted(set(devices) - said)} did not report, but their nodes "
                               f"{','.join(quiet)} answer")
        return {}

    def _clear(self, why: str) -> dict[str, str]:
        self.done = True
        self.ctl.set_probe(self.world, "clear")
        self.log(f"no node is gone ({why}): each failed worker's own error stands")
        return {}
