"""The Slurm node backend: workers as `srun --overlap` steps of the running job, and of its companion jobs.

One step per node inside the running allocation; nodes go back with `scontrol update
JobId=... NodeList=...`. Growing beyond the nodes the job holds submits a companion job
(launcher.backends.slurm_client.build_companion_command): Slurm 22.05 cannot grow a job with
GRES and never gives released nodes back, so the extra nodes come as a second batch job in the
same partition, whole nodes with the same GPUs and tasks per node, named <job>-companion-<n>.
Workers on its nodes are steps of the companion job; giving its nodes back shrinks or cancels it.
"""
from __future__ import annotations

import signal as signal_module
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from launcher import control as C
from launcher.backends.base import Acquired, AcquireFailed, NodeHandle, Reporter, resolve_python, stop_handle
from launcher.backends.slurm_client import (
    JobInfo,
    SlurmError,
    build_companion_command,
    build_companion_script,
    build_shrink_command,
    build_srun_command,
    parse_task_end,
)

# Slurm states of a job that will never run (again)
ENDED_STATES = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "TIMEOUT")


class SlurmNodes:
    """Workers as steps of the running Slurm job `job_id` (and of its companion jobs), through a
    Slurm client (launcher.backends.slurm_client.SlurmBackend)."""

    released_nodes_return = False  # Slurm never gives a job its released nodes back

    def __init__(self, slurm, job_id: int, gpus_per_node: int, info: JobInfo | None = None,
                 log_dir: Path | None = None) -> None:
        self.slurm, self.job_id, self.gpus_per_node = slurm, job_id, gpus_per_node
        self.info = info or slurm.job_info(job_id)
        self.log_dir = log_dir
        self.held: dict[int, list[str]] = {int(job_id): list(self.info.nodes)}  # Slurm job -> nodes it holds
        self.node_job: dict[str, int] = {}  # node -> the companion job it belongs to
        self.companion_batch: dict[int, str] = {}  # companion job -> its batch host (never shrunk away)
        self.companions_submitted = 0

    def gpus_on(self, node: str) -> int:
        """GPUs of `node` the workers use: --gpus-per-node on every node (uneven Slurm nodes: not yet)."""
        return self.gpus_per_node

    def component_of(self, node: str) -> int:
        """The het-job component of `node` (0: a plain job; a heterogeneous allocation, read by
        launcher.allocation, numbers its components by HetJobOffset)."""
        return 0

    def allocation(self) -> list[str]:
        nodes = list(self.info.nodes)
        if self.info.batch_host in nodes:  # the batch node first: it is pinned and always used
            nodes.remove(self.info.batch_host)
            nodes.insert(0, self.info.batch_host)
        return nodes

    @property
    def batch_node(self) -> str:
        return self.info.batch_host or self.info.nodes[0]

    def describe(self) -> str:
        return f"Slurm job {self.job_id} ({type(self.slurm).__name__}) on {','.join(self.allocation())}"

    def default_master_addr(self) -> str:
        """This host's address: the launcher runs in the batch step, the workers on other nodes."""
        return socket.gethostbyname(socket.gethostname()) if self.info.batch_host else "127.0.0.1"

    def step_env(self, node: str, index: int, base: Mapping[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update({C.ENV_NODE: node, C.ENV_NODE_INDEX: str(index)})
        return env

    def job_of(self, node: str) -> int:
        """The Slurm job whose steps run on `node`: a companion job's, else the launcher's own."""
        return self.node_job.get(node, self.job_id)

    # -- workers ------------------------------------------------------------------------------
    def commands_for_start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> list[list[str]]:
        return [build_srun_command(self.job_of(node), [node], self.gpus_per_node, self.gpus_per_node,
                                   self.step_env(node, index, base), resolve_python(argv))]

    def commands_for_release(self, keep: Sequence[str]) -> list[list[str]]:
        return [build_shrink_command(self.job_id, keep)]

    def start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> NodeHandle:
        """Start the node's step; srun's stderr is read here (and passed on to the log) so that a task
        that dies while the others run on is seen at once (NodeHandle.task_exits)."""
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"step-{node}.log", "ab")
        job = self.job_of(node)
        kwargs = {"other_job": True} if job != self.job_id else {}  # a companion's step: none of our SLURM_*
        step = self.slurm.start_step(job, [node], self.gpus_per_node, self.gpus_per_node,
                                     self.step_env(node, index, base), resolve_python(argv),
                                     stdout=out, stderr=subprocess.PIPE, **kwargs)
        handle = NodeHandle(node, [index * self.gpus_per_node + g for g in range(self.gpus_per_node)], step=step)
        handle.reader = threading.Thread(target=_watch_tasks, args=(step.stderr, out, handle), daemon=True)
        handle.reader.start()
        return handle

    def stop(self, handle: NodeHandle, timeout: float) -> bool:
        return stop_handle(handle, timeout)

    def signal(self, handle: NodeHandle, sig: int = signal_module.SIGTERM) -> None:
        handle.signal(sig)  # srun forwards it to the step's tasks

    def keep_rank(self, node: str) -> int:
        """The job's own nodes first, then a companion's batch host (it can only be cancelled, not
        shrunk away), then the companions' other nodes."""
        return 0 if node not in self.node_job else 1 if self.is_companion_batch(node) else 2

    def release(self, keep: Sequence[str]) -> list[str]:
        """Give back every node not in `keep`: shrink the launcher's job (only when it loses nodes),
        shrink a companion job that keeps some nodes, cancel one that keeps none."""
        before = set(self.companion_jobs())
        keep_set = set(keep)
        main = int(self.job_id)
        kept_main = [n for n in self.held[main] if n in keep_set]
        if kept_main != self.held[main]:
            self.slurm.shrink(self.job_id, kept_main)
            self.held[main] = kept_main
        for job in self.companion_jobs():
            kept = [n for n in self.held[job] if n in keep_set]
            if not kept:
                self.cancel_companion(job)
            elif kept != self.held[job]:
                self.slurm.shrink(job, kept)
                for n in set(self.held[job]) - set(kept):
                    self.node_job.pop(n, None)
                self.held[job] = kept
        ended = sorted(before - set(self.companion_jobs()))
        if not ended:
            return []
        return [f"companion job {', '.join(map(str, ended))} cancelled"]

    # -- companion jobs -------------------------------------------------------------------------
    @property
    def partition(self) -> str:
        return self.info.partition or ""

    def companion_command(self, job_name: str, n: int, nodes: int, exclude: Sequence[str]) -> tuple[list[str], str]:
        """(sbatch argv, script) of companion job number n: pure, what submit_companion runs."""
        output = self.log_dir / f"companion-{n}-%j.out" if self.log_dir is not None else "/dev/null"
        return (build_companion_command(job_name, n, nodes, self.gpus_per_node, self.partition, exclude, output),
                build_companion_script(self.job_id))

    def submit_companion(self, job_name: str, nodes: int, exclude: Sequence[str]) -> int:
        """Submit the next companion job asking for `nodes` nodes (not `exclude`); returns its Slurm id."""
        self.companions_submitted += 1
        cmd, script = self.companion_command(job_name, self.companions_submitted, nodes, exclude)
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.slurm.submit(script, extra_args=cmd[2:])  # cmd = sbatch --parsable ARGS

    def acquire(self, count: int, *, job_name: str, exclude: Sequence[str], timeout: float,
                report: Reporter) -> Acquired:
        """Submit a companion job for `count` more nodes and wait up to `timeout` s until it runs.
        One that cannot be submitted, ends, or does not start in time is cancelled (AcquireFailed)."""
        try:
            cid = self.submit_companion(job_name, count, exclude)
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
        for cid in self.companion_jobs():
            try:
                self.cancel_companion(cid)
            except Exception as exc:  # noqa: BLE001 -- leaving anyway; the companion's script ends with the job
                report.log(f"cancelling companion job {cid} failed: {exc}")

    def adopt_companion(self, job_id: int, nodes: Sequence[str], batch_host: str | None) -> None:
        """The companion job runs on `nodes`: its steps run the workers there from now on."""
        self.held[int(job_id)] = list(nodes)
        self.companion_batch[int(job_id)] = batch_host or nodes[0]
        for n in nodes:
            self.node_job[n] = int(job_id)

    def cancel_companion(self, job_id: int) -> None:
        """scancel the companion job (pending or running) and forget its nodes."""
        job_id = int(job_id)
        try:
            self.slurm.cancel(job_id)
        finally:
            for n in self.held.pop(job_id, []):
                if self.node_job.get(n) == job_id:
                    del self.node_job[n]
            self.companion_batch.pop(job_id, None)

    def companion_jobs(self) -> list[int]:
        return [j for j in self.held if j != int(self.job_id)]

    def is_companion_batch(self, node: str) -> bool:
        return node in self.node_job and self.companion_batch.get(self.node_job[node]) == node


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

