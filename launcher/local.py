"""Node backends: where the launcher starts a node's workers and how it gives nodes back.

`LocalNodes` (the embedded default, for machines without Slurm and for `elastic demo`) runs
the workers as processes on this machine, one per device of N simulated nodes. `SlurmNodes`
starts one `srun --overlap` step per node inside the running allocation and returns nodes with
`scontrol update JobId=... NodeList=...`. Both build their commands with pure functions first
(`commands_for_start`, `commands_for_release`), which is what `elastic-launch --dry-run` prints.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from launcher import control as C


def resolve_python(argv: Sequence[str]) -> list[str]:
    """`python ...` runs with this interpreter, so workers see the launcher's environment (venv)."""
    argv = list(argv)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


class NodeHandle:
    """The workers of one node: per-device processes (local) or one srun step (Slurm)."""

    def __init__(self, node: str, devices: list[int], procs: dict[int, subprocess.Popen] | None = None,
                 step: subprocess.Popen | None = None) -> None:
        self.node, self.devices, self.procs, self.step = node, devices, procs or {}, step

    def exited(self) -> dict[int, int]:
        """device -> exit code, for the devices whose worker has ended."""
        if self.step is not None:
            rc = self.step.poll()
            return {} if rc is None else {d: rc for d in self.devices}
        return {d: p.returncode for d, p in self.procs.items() if p.poll() is not None}

    def all_exited(self) -> bool:
        return len(self.exited()) == len(self.devices)

    def kill(self) -> None:
        for p in ([self.step] if self.step else []) + list(self.procs.values()):
            if p.poll() is None:
                p.kill()
        for p in ([self.step] if self.step else []) + list(self.procs.values()):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def kill_device(self, device: int) -> None:
        """Fault injection for tests and demos (local backend only)."""
        self.procs[device].kill()


class LocalNodes:
    """`nodes` simulated nodes of `gpus_per_node` devices, every worker a process here."""

    name = "local"

    def __init__(self, nodes: int, gpus_per_node: int, log_dir: Path | None = None) -> None:
        self.names = [f"node{i}" for i in range(nodes)]
        self.gpus_per_node = gpus_per_node
        self.log_dir = log_dir
        self.released: list[list[str]] = []

    def allocation(self) -> list[str]:
        return list(self.names)

    @property
    def batch_node(self) -> str:
        return self.names[0]

    def describe(self) -> str:
        return f"local backend: {len(self.names)} simulated nodes x {self.gpus_per_node} devices on this machine"

    def worker_env(self, node: str, index: int, base: Mapping[str, str]) -> list[dict[str, str]]:
        out = []
        for g in range(self.gpus_per_node):
            env = dict(base)
            env.update({C.ENV_DEVICE: str(index * self.gpus_per_node + g), C.ENV_LOCAL_ID: str(g),
                        C.ENV_NODE: node, C.ENV_NODE_INDEX: str(index)})
            out.append(env)
        return out

    def commands_for_start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> list[list[str]]:
        return [["env", *[f"{k}={v}" for k, v in sorted(env.items())], *resolve_python(argv)]
                for env in self.worker_env(node, index, base)]

    def commands_for_release(self, keep: Sequence[str]) -> list[list[str]]:
        return []  # nothing to tell anybody: the processes are gone

    def start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> NodeHandle:
        procs = {}
        for env in self.worker_env(node, index, base):
            dev = int(env[C.ENV_DEVICE])
            full = dict(os.environ)
            full.update(env)
            out = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"worker-dev{dev}.log", "ab")
            procs[dev] = subprocess.Popen(resolve_python(argv), env=full, stdout=out, stderr=subprocess.STDOUT if out else None)
            if out is not None:
                out.close()
        return NodeHandle(node, sorted(procs), procs=procs)

    def release(self, keep: Sequence[str]) -> None:
        self.released.append(list(keep))


class SlurmNodes:
    """Workers as `srun --overlap` steps of the running Slurm job `job_id`, and of its companion jobs.

    A companion job (launcher.slurm.build_companion_command) holds nodes beyond the allocation:
    Slurm 22.05 cannot grow a job with GRES and never gives released nodes back. Workers on its
    nodes are steps of the companion job; giving its nodes back shrinks or cancels it.
    """

    name = "slurm"

    def __init__(self, slurm, job_id: int, gpus_per_node: int, info=None, log_dir: Path | None = None) -> None:
        self.slurm, self.job_id, self.gpus_per_node = slurm, job_id, gpus_per_node
        self.info = info or slurm.job_info(job_id)
        self.log_dir = log_dir
        self.held: dict[int, list[str]] = {int(job_id): list(self.info.nodes)}  # Slurm job -> nodes it holds
        self.node_job: dict[str, int] = {}  # node -> the companion job it belongs to
        self.companion_batch: dict[int, str] = {}  # companion job -> its batch host (never shrunk away)
        self.companions_submitted = 0

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

    def step_env(self, node: str, index: int, base: Mapping[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update({C.ENV_NODE: node, C.ENV_NODE_INDEX: str(index)})
        return env

    def job_of(self, node: str) -> int:
        """The Slurm job whose steps run on `node`: a companion job's, else the launcher's own."""
        return self.node_job.get(node, self.job_id)

    def commands_for_start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> list[list[str]]:
        from launcher.slurm import build_srun_command

        return [build_srun_command(self.job_of(node), [node], self.gpus_per_node, self.gpus_per_node,
                                   self.step_env(node, index, base), resolve_python(argv))]

    def commands_for_release(self, keep: Sequence[str]) -> list[list[str]]:
        from launcher.slurm import build_shrink_command

        return [build_shrink_command(self.job_id, keep)]

    def start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> NodeHandle:
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"step-{node}.log", "ab")
        job = self.job_of(node)
        kwargs = {"other_job": True} if job != self.job_id else {}  # a companion's step: none of our SLURM_*
        step = self.slurm.start_step(job, [node], self.gpus_per_node, self.gpus_per_node,
                                     self.step_env(node, index, base), resolve_python(argv),
                                     stdout=out, stderr=subprocess.STDOUT if out else None, **kwargs)
        if out is not None:
            out.close()
        return NodeHandle(node, [index * self.gpus_per_node + g for g in range(self.gpus_per_node)], step=step)

    # -- companion jobs -------------------------------------------------------------------------
    @property
    def partition(self) -> str:
        return getattr(self.info, "partition", "") or ""

    def companion_command(self, job_name: str, n: int, nodes: int, exclude: Sequence[str]) -> tuple[list[str], str]:
        """(sbatch argv, script) of companion job number n: pure, what submit_companion runs."""
        from launcher.slurm import build_companion_command, build_companion_script

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

    def companion_info(self, job_id: int):
        return self.slurm.job_info(job_id)

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

    def release(self, keep: Sequence[str]) -> None:
        """Give back every node not in `keep`: shrink the launcher's job (only when it loses nodes),
        shrink a companion job that keeps some nodes, cancel one that keeps none."""
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


def shell_line(cmd: Sequence[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
