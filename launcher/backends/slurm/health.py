"""Is a node of the job gone? Asked when the job's collectives failed and no worker was seen ending
(launcher.loop.probe): a crashed node's step just goes quiet, and Slurm's own pings notice a dead slurmd
only SlurmdTimeout later (30 s on the testbed, 300 s by default).

Two looks, the second only where the first says nothing: the node's state in Slurm (GONE_STATES, or `*`:
pings unanswered), then a one-task step on it (`srun ... true`), which cannot start where slurmd is gone.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence

from launcher.backends.slurm.client import SlurmError
from launcher.backends.slurm.parse import GONE_STATES

# idle nodes that are not free to grow onto: reserved, drained, planned by the backfill scheduler for a pending
# job (Slurm's own plan, what `squeue --start` shows), or on their way out of service
NOT_FREE = {"RESERVED", "DRAIN", "DRAINING", "PLANNED", "MAINTENANCE", "POWERED_DOWN", "POWER_DOWN", "POWERING_DOWN",
            "REBOOT_REQUESTED", "NOT_RESPONDING", "COMPLETING"}
PROBE_STEP_S = 15.0  # a one-task step on a node whose slurmd is gone: srun gives up after MessageTimeout (10 s)


def find_draining(slurm, nodes: Sequence[str], max_age: float = 0.0) -> dict[str, str]:
    """node -> what Slurm says, for the `nodes` it drains (DRAINING, DRAINED, or a state with +DRAIN); a read of
    the nodes up to `max_age` s old will do (the routine looks share one)."""
    try:
        states = slurm.node_states(nodes, max_age=max_age)
    except SlurmError as exc:  # slurmctld busy: asked again at the next look
        print(f"[elastic-launch] reading node states failed: {exc}", file=sys.stderr, flush=True)
        return {}
    return {n: f"Slurm says it is {state}" for n, (state, _) in states.items() if n in nodes and "drain" in state}


def partition_view(slurm, partition: str, own: set[int], max_age: float = 0.0):
    """What launcher.policy.opportunistic reads: the free idle nodes of `partition` (all partitions when empty;
    NOT_FREE flags keep a node out), the jobs pending there but the elastic job's own (`own`: itself, its
    companions), and the opportunistic elastic jobs running there (their Slurm comments: launcher.policy.peers)."""
    from launcher.policy.opportunistic import pending_view

    try:
        nodes, jobs = slurm.nodes(max_age=max_age), slurm.jobs(max_age=max_age)
    except SlurmError as exc:  # slurmctld busy: nothing decided this time
        print(f"[elastic-launch] reading the partition failed: {exc}", file=sys.stderr, flush=True)
        return None
    idle = [n.name for n in nodes if n.state == "idle" and not set(n.flags) & NOT_FREE
            and (not partition or partition in n.partitions)]
    return pending_view(idle, [j for j in jobs if not partition or j.partition == partition], own=tuple(own))


def find_gone(slurm, nodes: Sequence[str], step_of: Callable[[str], tuple[int, dict]] | None,
              max_age: float = 0.0) -> dict[str, str]:
    """node -> what showed it gone, for the `nodes` that are. `step_of(node)` -> (srun --jobid, options) of
    the job or component that holds it (its het_group); None: Slurm's word only, no step, and only a node
    it calls down or failed (the cheap look the launcher takes now and then, from a read of the nodes up to
    `max_age` s old). The steps run side by side."""
    if not nodes:
        return {}
    gone: dict[str, str] = {}
    try:
        states = slurm.node_states(nodes, max_age=max_age if step_of is None else 0.0)
        for n, (state, answering) in states.items():
            # pings unanswered count only when the job's own collectives failed too (a busy slurmd may miss one)
            if n in nodes and (state in GONE_STATES or (not answering and step_of is not None)):
                gone[n] = f"Slurm says it is {state}{'' if answering else ', not responding'}"
    except SlurmError as exc:  # slurmctld busy: the steps below still tell
        print(f"[elastic-launch] reading node states failed: {exc}", file=sys.stderr, flush=True)
    if step_of is None:
        return gone
    found: dict[str, str | None] = {}

    def probe(node: str) -> None:
        job, opts = step_of(node)
        found[node] = slurm.probe_node(job, node, PROBE_STEP_S, opts.get("het_group"))

    threads = [threading.Thread(target=probe, args=(n,), daemon=True) for n in nodes if n not in gone]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROBE_STEP_S + 5)
    gone.update({n: why for n, why in found.items() if why is not None})
    return gone


def lost_gres(slurm, job_id: int, node: str, gpus: int, het_group: int | None = None) -> str | None:
    """What Slurm said when a one-task step asking for `gpus` GPUs on `node` was refused for its GRES, else
    None. Measured on the testbed (Slurm 22.05): a --no-kill job requeued while its crashed batch node was
    being taken out of it starts again with its GPU bookkeeping gone ("_step_get_gres_cnt ... node offset
    invalid"), and every step asking for --gres is refused ("Invalid generic resource (gres)
    specification", with no --gres too: the job's own request applies), while steps with --gres=none run."""
    if gpus < 1:
        return None
    why = slurm.probe_node(job_id, node, PROBE_STEP_S, het_group, gpus=gpus)
    return why if why is not None and "generic resource" in why else None
