"""The Slurm node backend: workers as `srun --overlap` steps of the running job, of its heterogeneous
components, and of its companion jobs.

One step per node inside the allocation, as many tasks as the GPUs the job holds on that node (nodes
may differ: launcher.backends.slurm.allocation reads them). In a heterogeneous job (`#SBATCH hetjob`) the steps of a
component's nodes are `srun --jobid=<leader> --het-group=<offset>`. Nodes go back as far as Slurm
allows (launcher.backends.slurm.holdings: `scontrol update` of the job or component that holds them,
`scancel` of a whole non-leader component or companion; a heterogeneous job's leader component
cannot be resized, so its nodes stay allocated, idle, and the migration's history says so).
Growing beyond the nodes held submits a companion job (launcher.backends.slurm.commands.
build_companion_command): Slurm 22.05 cannot grow a job with GRES and never gives released nodes
back, so the extra nodes come as a second batch job shaped like the component it extends (its
partition, its GPUs per node), named <job>-companion-<n>. Workers on its nodes are steps of the
companion job; giving its nodes back shrinks or cancels it.
"""
from __future__ import annotations

import dataclasses
import signal as signal_module
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from launcher.wire.env import ENV_FIRST_DEVICE, ENV_GPUS_PER_NODE, ENV_NODE, ENV_NODE_INDEX
from launcher.backends.base import Acquired, AcquireFailed, NodeHandle, Reporter, resolve_python, stop_handle
from launcher.backends.slurm.client import SlurmError
from launcher.backends.slurm.commands import (
    build_companion_command,
    build_companion_script,
    build_shrink_command,
    build_srun_command,
)
from launcher.backends.slurm.health import find_draining, find_gone, lost_gres, partition_view
from launcher.backends.slurm.parse import JobInfo, parse_task_end
from launcher.backends.slurm.successor import Successor, takeover_reason
from launcher.backends.slurm.holdings import (
    COMPANION,
    COMPONENT,
    JOB,
    LEADER,
    Holder,
    companion_shape,
    holder_of,
    keep_rank,
    plan_release,
)

#: the first release that starts `--gres=gpu:G` steps on a node above the job's smallest per-node share (22.05
#: refuses them, so it gets `--gpus=G` steps, which 24.11 and 26.05 start only one at a time: measured)
PER_NODE_GRES_ON_UNEVEN = (23, 2)
#: seconds a read of every node serves the routine looks, which come every 30 s (launcher.loop.probe, .drain,
#: the policy's default, like Slurm's own backfill scheduler): a little less, so each round reads once
READ_AGE_S = 25.0
#: why a node's crash ends the whole job, by what the allocation's --no-kill reads (SlurmClient.no_kill)
NODE_LOSS_ENDS_JOB = {
    False: "on Slurm the whole job ends when one of its nodes fails: it was submitted without --no-kill "
           "(add `#SBATCH --no-kill` to the script)",
    None: "on Slurm the whole job ends when one of its nodes fails unless it was submitted with --no-kill, which "
          "could not be read back (no accounting, no batch script): add `#SBATCH --no-kill` to be sure",
}

# Slurm states of a job that will never run (again)
ENDED_STATES = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "TIMEOUT")


def holders_of(allocation, gpus_per_node: int) -> tuple[list[Holder], dict[str, int]]:
    """(Holders, node -> workers) of a launcher.backends.slurm.allocation.Allocation: each node runs as many workers as
    GPUs the job holds there, at most `gpus_per_node` (--gpus-per-node); a node without GPUs, that many."""
    het = allocation.heterogeneous
    holders = [Holder(c.job_id, (LEADER if c.offset == 0 else COMPONENT) if het else JOB, tuple(c.nodes),
                      c.batch_host, c.partition, c.offset if het else None,
                      allocation.job_id if het else None, c.offset if het else None)
               for c in allocation.components]
    gpus = {n: min(g, gpus_per_node) if g > 0 else gpus_per_node for n, g in allocation.gpus().items()}
    return holders, gpus


class SlurmNodes:
    """Workers as steps of the running Slurm job `job_id` (a plain job or a heterogeneous job's leader),
    of its components and of its companion jobs, through a Slurm client
    (launcher.backends.slurm.client.SlurmClient). `allocation` (launcher.backends.slurm.allocation.Allocation) says
    what the job holds per component and node; without it every node of `info` has `gpus_per_node`."""

    released_nodes_return = False  # Slurm never gives a job its released nodes back
    probe_s = 30.0  # node states, then a one-task step per quiet node (PROBE_STEP_S each, side by side)

    def __init__(self, slurm, job_id: int, gpus_per_node: int, info: JobInfo | None = None,
                 log_dir: Path | None = None, allocation=None, no_kill: bool | None = True) -> None:
        self.slurm, self.job_id, self.gpus_per_node, self.log_dir = slurm, job_id, gpus_per_node, log_dir
        self.node_loss_ends_job = None if no_kill else NODE_LOSS_ENDS_JOB[no_kill]
        self.info = info or slurm.job_info(job_id)
        self.step_gres = True  # steps ask for their GPUs (--gres); --gres=none where Slurm lost them (check_gres)
        # the routine looks (node health, drains, the policy's partition) answer from one read of every node at
        # most this old: a job asks slurmctld a few times a minute, not once per look (launch.py lowers it to
        # --policy-watch)
        self.read_age_s = READ_AGE_S
        if allocation is not None:
            holders, self.gpus = holders_of(allocation, gpus_per_node)
        else:
            holders = [Holder(int(job_id), JOB, tuple(self.info.nodes), self.info.batch_host, self.info.partition)]
            self.gpus = {n: gpus_per_node for n in self.info.nodes}
        self.start_holders = tuple(holders)
        self.holders: dict[int, Holder] = {h.job_id: h for h in holders}  # Slurm job -> what it holds now
        nodes = [n for h in holders for n in h.nodes]
        if self.batch_node in nodes:  # the batch node first: it is pinned and always used
            nodes = [self.batch_node] + [n for n in nodes if n != self.batch_node]
        self.order = nodes  # every node ever held, in the launcher's topology order (device ids follow it)
        self.idle: set[str] = set()  # nodes Slurm would not release: allocated, no workers
        # a plain job whose nodes hold different GPU counts refuses --gres=gpu:N steps above its smallest share
        self.uneven = len({self.gpus[n] for n in nodes}) > 1 and allocation is not None and not allocation.heterogeneous
        self.companions_submitted, self.shapes = 0, {}  # shapes: companion job -> the shape it was submitted with
        self.successor: Successor | None = None  # the job held in the queue to take this one over

    # -- what the job holds -----------------------------------------------------------------------
    def holder(self, node: str) -> Holder | None:
        return holder_of(list(self.holders.values()), node)

    def holds(self, node: str) -> bool:
        return self.holder(node) is not None

    def gpus_on(self, node: str) -> int:
        """Workers of `node`: the GPUs the job holds there (at most --gpus-per-node)."""
        return self.gpus.get(node, self.gpus_per_node)

    def component_of(self, node: str) -> int:
        """The heterogeneous-job component `node` belongs to (a companion's: the one it extends); 0: plain job."""
        h = self.holder(node)
        return h.component if h is not None and h.component is not None else 0

    def first_device(self, node: str) -> int:
        """Device id of `node`'s GPU 0, numbered in the order nodes were first held (Topology.of_nodes)."""
        first = 0
        for n in self.order:
            if n == node:
                return first
            first += self.gpus_on(n)
        raise KeyError(f"{node} was never held by Slurm job {self.job_id}")

    def allocation(self) -> list[str]:
        return [n for n in self.order if self.holds(n)]

    def output_files(self, node: str, devices) -> list[Path]:  # one srun step, and one log, per node
        return [] if self.log_dir is None else [self.log_dir / f"step-{node}.log"]

    @property
    def batch_node(self) -> str:
        return self.info.batch_host or self.info.nodes[0]

    def describe(self) -> str:
        parts = [f"{h.label}: {','.join(f'{n}({self.gpus_on(n)})' for n in h.nodes)}" for h in self.holders.values()
                 if h.component is not None]
        sizes = f"; {'; '.join(parts)}" if parts else ""
        return f"Slurm job {self.job_id} ({type(self.slurm).__name__}) on {','.join(self.allocation())}{sizes}"

    def default_master_addr(self) -> str:
        """This host's address: the launcher runs in the batch step, the workers on other nodes."""
        return socket.gethostbyname(socket.gethostname()) if self.info.batch_host else "127.0.0.1"

    def step_env(self, node: str, index: int, base: Mapping[str, str]) -> dict[str, str]:
        return {**base, ENV_NODE: node, ENV_NODE_INDEX: str(index), ENV_FIRST_DEVICE: str(self.first_device(node)),
                ENV_GPUS_PER_NODE: str(self.gpus_on(node))}

    def job_of(self, node: str) -> int:
        """The Slurm job holding `node` (a component's or companion's own id), else the launcher's own."""
        h = self.holder(node)
        return h.job_id if h is not None else int(self.job_id)

    # -- workers ------------------------------------------------------------------------------
    def step_of(self, node: str) -> tuple[int, dict]:
        """(srun --jobid, the other step options) of `node`'s step."""
        h = self.holder(node) or self.holders[int(self.job_id)]
        opts = {"het_group": h.het_group} if h.het_group is not None else {}
        if self.uneven and h.kind == JOB and self.slurm.release() < PER_NODE_GRES_ON_UNEVEN:
            opts["gpus_per_step"] = True
        if not self.step_gres:
            opts["gres_none"] = True
        return h.srun_job, opts

    def commands_for_start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> list[list[str]]:
        job, opts = self.step_of(node)
        g = self.gpus_on(node)
        return [build_srun_command(job, [node], g, g, self.step_env(node, index, base), resolve_python(argv), **opts)]

    def commands_for_release(self, keep: Sequence[str]) -> list[list[str]]:
        p = plan_release(list(self.holders.values()), keep, frozenset(self.idle))
        return [build_shrink_command(j, kept) for j, kept in p.shrink] + [["scancel", str(j)] for j in p.cancel]

    def start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> NodeHandle:
        """Start the node's step; srun's stderr is read here (and passed on to the log) so that a task
        that dies while the others run on is seen at once (NodeHandle.task_exits)."""
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"step-{node}.log", "ab")
        job, opts = self.step_of(node)
        h = self.holder(node)
        if h is not None and h.kind == COMPANION:
            opts["other_job"] = True  # a companion's step: none of our SLURM_*
        g = self.gpus_on(node)
        step = self.slurm.start_step(job, [node], g, g, self.step_env(node, index, base), resolve_python(argv),
                                     stdout=out, stderr=subprocess.PIPE, **opts)
        self.idle.discard(node)
        first = self.first_device(node)
        handle = NodeHandle(node, list(range(first, first + g)), step=step)
        handle.reader = threading.Thread(target=_watch_tasks, args=(step.stderr, out, handle), daemon=True)
        handle.reader.start()
        return handle

    def stop(self, handle: NodeHandle, timeout: float) -> bool:
        return stop_handle(handle, timeout)

    def signal(self, handle: NodeHandle, sig: int = signal_module.SIGTERM) -> None:
        """Signal the node's tasks through slurmctld (srun itself would SIGKILL them on a SIGTERM); a step
        Slurm does not list yet (srun just started) gets the signal through srun."""
        if handle.step is not None and handle.step.poll() is None:
            try:
                if self.slurm.signal_step_on(self.job_of(handle.node), handle.node, sig) is not None:
                    return
            except SlurmError as exc:
                print(f"[elastic-launch] signalling the step on {handle.node} through Slurm failed: {exc}; "
                      "signalling srun", file=sys.stderr, flush=True)
        handle.signal(sig)

    # -- the cluster's word: a node gone (launcher.loop.probe), drained (loop.drain), the queue (policy) -----
    def unreachable(self, nodes: Sequence[str], steps: bool = True) -> dict[str, str]:
        return find_gone(self.slurm, nodes, self.step_of if steps else None, max_age=self.read_age_s)

    def draining(self, nodes: Sequence[str]) -> dict[str, str]:
        return find_draining(self.slurm, nodes, max_age=self.read_age_s)

    def cluster_view(self):
        return partition_view(self.slurm, self.info.partition, own=set(self.holders), max_age=self.read_age_s)

    def announce(self, mark: str) -> None:
        self.slurm.set_comment(self.job_id, mark)

    def queue_successor(self, job_name: str, min_nodes: int, max_nodes: int) -> int:
        self.successor = Successor(self.slurm, self.job_id, job_name, min_nodes, max_nodes)
        return self.successor.submit()

    def keep_successor(self) -> str | None:
        return self.successor.keep() if self.successor is not None else None

    def takeover_reason(self, predecessor: str) -> str | None:
        return takeover_reason(self.slurm, predecessor)

    def check_gres(self) -> str | None:
        """A requeued run: where Slurm refuses GPU requests (slurm.health.lost_gres), steps ask --gres=none."""
        batch = self.batch_node
        job, opts = self.step_of(batch)
        why = lost_gres(self.slurm, job, batch, self.gpus_on(batch), opts.get("het_group"))
        self.step_gres = why is None
        return why

    def forget(self, node: str) -> list[str]:
        """`node` is gone: out of the job as far as Slurm lets (a DOWN node it takes out of a --no-kill job itself)."""
        try:
            notes = self.release([n for n in self.allocation() if n != node])
            return [f"{node} taken out of the job's allocation", *notes]
        except SlurmError as exc:
            h = self.holder(node)
            if h is not None:
                self.holders[h.job_id] = dataclasses.replace(h, nodes=tuple(n for n in h.nodes if n != node))
            return [f"taking {node} out of Slurm job {h.job_id if h else self.job_id} failed ({exc}); Slurm drops "
                    "a DOWN node from a --no-kill job itself"]

    def keep_rank(self, node: str) -> int:
        """Nodes that cannot be given back first (slurm_holdings.keep_rank)."""
        return keep_rank(self.holder(node), node)

    def release(self, keep: Sequence[str]) -> list[str]:
        """Give back every node not in `keep` as far as Slurm allows (slurm_holdings.plan_release): shrink
        the jobs and components that keep some nodes, cancel companions and components that keep none;
        nodes Slurm would not release stay allocated, idle (`holds` says so). Returns the notes."""
        p = plan_release(list(self.holders.values()), keep, frozenset(self.idle))
        for job, kept in p.shrink:
            self.slurm.shrink(job, list(kept))
            self.holders[job] = dataclasses.replace(self.holders[job], nodes=kept)
        for job in p.cancel:
            self.cancel_companion(job)
        self.idle |= set(p.idle)
        return list(p.notes)

    # -- companion jobs -------------------------------------------------------------------------
    @property
    def partition(self) -> str:
        return self.info.partition or ""

    def shape(self):
        """The next companion job's ask: like the component that lost the most nodes (companion_shape)."""
        return companion_shape(self.start_holders, list(self.holders.values()), self.gpus)

    def companion_command(self, job_name: str, n: int, nodes: int, exclude: Sequence[str],
                          whole: bool = False) -> tuple[list[str], str]:
        """(sbatch argv, script) of companion job number n: pure, what submit_companion runs."""
        output = self.log_dir / f"companion-{n}-%j.out" if self.log_dir is not None else "/dev/null"
        shape = self.shape()
        return (build_companion_command(job_name, n, nodes, shape.gpus, shape.partition, exclude, output,
                                        self.job_id, whole),
                build_companion_script(self.job_id))

    def submit_companion(self, job_name: str, nodes: int, exclude: Sequence[str], whole: bool = False) -> int:
        """Submit the next companion job asking for `nodes` nodes (not `exclude`); returns its Slurm id."""
        self.companions_submitted += 1
        cmd, script = self.companion_command(job_name, self.companions_submitted, nodes, exclude, whole)
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        shape = self.shape()
        cid = self.slurm.submit(script, extra_args=cmd[2:])  # cmd = sbatch --parsable ARGS
        self.shapes[cid] = shape
        return cid

    def acquire(self, count: int, *, job_name: str, exclude: Sequence[str], timeout: float,
                report: Reporter, whole: bool = False) -> Acquired:
        """Submit a companion job for `count` more nodes and wait up to `timeout` s until it runs.
        One that cannot be submitted, ends, or does not start in time is cancelled (AcquireFailed)."""
        try:
            cid = self.submit_companion(job_name, count, exclude, whole)
        except SlurmError as exc:  # sbatch refused it
            raise AcquireFailed(f"companion job for {count} more node(s) could not be submitted: {exc}") from None
        report.log(f"companion job {cid}: asking Slurm for {count} more node(s), waiting up to {timeout:.0f} s")
        report.audit("companion", f"companion job {cid} submitted for {count} more node(s)")
        deadline = time.monotonic() + timeout
        info = self._wait_running(cid, count, timeout, deadline, report)
        nodes = list(info.nodes)
        self.adopt_companion(cid, nodes, info.batch_host)
        report.log(f"companion job {cid} runs on {','.join(nodes)}")
        report.audit("companion", f"companion job {cid} started on {','.join(nodes)}")
        return Acquired(tuple(nodes), f"companion job {cid}", cid, deadline)

    def _wait_running(self, cid: int, count: int, timeout: float, deadline: float, report: Reporter) -> JobInfo:
        """Poll companion job `cid` until it runs on `count` nodes; cancel it when it cannot."""
        info = None
        while True:
            try:
                info = self.slurm.job_info(cid)
            except (SlurmError, ValueError) as exc:  # slurmctld busy or away for a moment: ask again
                report.log(f"companion job {cid}: {exc}")
            if info is not None:
                state = info.state.upper()
                if state == "RUNNING" and len(info.nodes) >= count:
                    return info
                if state in ENDED_STATES:
                    self._cancel(cid, f"it ended ({info.state}) before it started", report)
                    raise AcquireFailed(f"companion job {cid} ended ({info.state}) before it started")
            if time.monotonic() >= deadline:
                why = f" (Slurm: {info.state}, reason {info.reason or 'none'})" if info is not None else ""
                self._cancel(cid, "it did not start in time", report)
                raise AcquireFailed(f"companion job {cid} did not start within {timeout:.0f} s{why}; cancelled, "
                                    "the job keeps training on what it has")
            time.sleep(min(0.5, max(timeout / 10, 0.05)))

    def abandon(self, acquired: Acquired, why: str, report: Reporter) -> None:
        self._cancel(int(acquired.token), why, report)

    def _cancel(self, cid: int, why: str, report: Reporter) -> None:
        try:
            self.cancel_companion(cid)
        except SlurmError as exc:  # already gone, or slurmctld away: the companion's script ends with the job
            report.log(f"cancelling companion job {cid} failed: {exc}")
        report.log(f"companion job {cid} cancelled: {why}")
        report.audit("companion", f"companion job {cid} cancelled: {why}")

    def close(self, report: Reporter) -> None:
        """The launcher ends the job: its successor (nothing to take over) and its companions go."""
        if self.successor is not None:
            try:
                self.successor.cancel()
            except Exception as exc:  # noqa: BLE001 -- leaving anyway; it finds the job ended and leaves
                report.log(f"cancelling successor job {self.successor.id} failed: {exc}")
        for cid in self.companion_jobs():
            try:
                self.cancel_companion(cid)
            except Exception as exc:  # noqa: BLE001 -- leaving anyway; the companion's script ends with the job
                report.log(f"cancelling companion job {cid} failed: {exc}")

    def adopt_companion(self, job_id: int, nodes: Sequence[str], batch_host: str | None) -> None:
        """The companion job runs on `nodes`: its steps run the workers there now, shaped as it was asked."""
        shape = self.shapes.pop(int(job_id), None) or self.shape()
        self.holders[int(job_id)] = Holder(int(job_id), COMPANION, tuple(nodes), batch_host or nodes[0],
                                           shape.partition, shape.component)
        for n in nodes:
            self.gpus[n] = shape.gpus
            self.idle.discard(n)
            if n not in self.order:
                self.order.append(n)

    def cancel_companion(self, job_id: int) -> None:
        """scancel a companion job (pending or running) or a component (not the leader) and forget its nodes."""
        job_id = int(job_id)
        try:
            self.slurm.cancel(job_id)
        finally:
            gone = self.holders.pop(job_id, None)
            self.idle -= set(gone.nodes if gone is not None else ())

    def companion_jobs(self) -> list[int]:
        return [j for j, h in self.holders.items() if h.kind == COMPANION]

    def is_companion_batch(self, node: str) -> bool:
        h = self.holder(node)
        return h is not None and h.kind == COMPANION and h.batch_host == node

def _watch_tasks(stderr, out, handle: NodeHandle) -> None:
    """Pass srun's stderr on (to the step's log, else ours) and note each task that ended badly."""
    sink = out if out is not None else sys.stderr.buffer
    try:
        for raw in stderr:
            sink.write(raw)
            sink.flush()
            ended = parse_task_end(raw.decode(errors="replace"))
            if ended is not None:
                for task in ended[1]:
                    if 0 <= task < len(handle.devices):
                        handle.task_exits[handle.devices[task]] = ended[2]
    finally:
        if out is not None:
            out.close()

