"""The local node backend: every worker a process on this machine, one per device of N simulated nodes.

The embedded default for machines without Slurm, for `elastic demo` and for the tests. On a
machine without GPUs each "GPU" is one such process training on gloo (CPU). Workers are forked from
a process that has imported torch already (launcher.backends.forkserver) where `python` would run
them the same way; fork_server=False starts each one as a new interpreter, as srun does on a cluster.
"""
from __future__ import annotations

import os
import signal as signal_module
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from launcher.wire.env import ENV_DEVICE, ENV_GPUS_PER_NODE, ENV_LOCAL_ID, ENV_NODE, ENV_NODE_INDEX
from launcher.backends import forkserver
from launcher.backends.base import Acquired, CannotAcquire, NodeHandle, Reporter, resolve_python, stop_handle


class LocalNodes:
    """`nodes` simulated nodes of `gpus_per_node` devices (or `node_gpus[i]` on node i: uneven
    nodes), every worker a process here."""

    node_loss_ends_job = None  # a node is a group of processes here: its loss ends nothing else
    probe_s = 3.0  # a local worker's end is seen at once: a node cannot vanish unseen here
    released_nodes_return = True  # a released simulated node can be started again

    def __init__(self, nodes: int, gpus_per_node: int, log_dir: Path | None = None,
                 node_gpus: Sequence[int] = (), fork_server: bool = True) -> None:
        if node_gpus and len(node_gpus) != nodes:
            raise ValueError(f"{nodes} simulated nodes but {len(node_gpus)} GPU counts")
        self.names = [f"node{i}" for i in range(nodes)]
        self.sizes = list(node_gpus) or [gpus_per_node] * nodes
        self.gpus_per_node = max(self.sizes)
        self.first = [sum(self.sizes[:i]) for i in range(nodes)]  # device id of each node's GPU 0
        self.log_dir = log_dir
        self.released: list[list[str]] = []
        self.out: set[str] = set()  # released and not started since
        self.fork_server = fork_server

    def gpus_on(self, node: str) -> int:
        return self.sizes[self.names.index(node)]

    def component_of(self, node: str) -> int:
        return 0  # simulated nodes form one plain job

    def holds(self, node: str) -> bool:
        return node not in self.out

    def allocation(self) -> list[str]:
        return list(self.names)

    def output_files(self, node: str, devices) -> list[Path]:
        """One log per worker."""
        return [] if self.log_dir is None else [self.log_dir / f"worker-dev{d}.log" for d in sorted(devices)]

    def unreachable(self, nodes, steps: bool = True) -> dict[str, str]:
        return {}  # every worker is a child process: its end is seen, nothing goes quiet unseen

    def draining(self, nodes) -> dict[str, str]:
        return {}  # no cluster drains this machine's simulated nodes

    def cluster_view(self):
        return None  # no queue, no other jobs: --policy opportunistic needs Slurm

    def announce(self, mark: str) -> None:
        pass  # nobody else to tell

    successor = None  # this machine is the batch node: nothing could take over after it

    def queue_successor(self, job_name: str, min_nodes: int, max_nodes: int) -> None:
        return None

    def keep_successor(self) -> None:
        return None

    def takeover_reason(self, predecessor: str) -> str:
        return f"job {predecessor} ended"  # no successors here: never asked

    def forget(self, node: str) -> list[str]:
        return []

    @property
    def batch_node(self) -> str:
        return self.names[0]

    def describe(self) -> str:
        how = "workers forked from a process that has imported torch" if self.fork_server else \
            "every worker a new interpreter"
        devices = f"with {','.join(map(str, self.sizes))}" if len(set(self.sizes)) > 1 else f"x {self.gpus_per_node}"
        nodes = f"{len(self.names)} simulated node{'s' if len(self.names) != 1 else ''}"
        return f"local backend: {nodes} {devices} devices on this machine, {how}"

    def worker_env(self, node: str, index: int, base: Mapping[str, str]) -> list[dict[str, str]]:
        out = []
        for g in range(self.sizes[index]):
            env = dict(base)
            env.update({ENV_DEVICE: str(self.first[index] + g), ENV_LOCAL_ID: str(g),
                        ENV_NODE: node, ENV_NODE_INDEX: str(index)})
            if len(set(self.sizes)) > 1:  # the worker's LOCAL_WORLD_SIZE is its node's GPU count
                env[ENV_GPUS_PER_NODE] = str(self.sizes[index])
            out.append(env)
        return out

    def commands_for_start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> list[list[str]]:
        return [["env", *[f"{k}={v}" for k, v in sorted(env.items())], *resolve_python(argv)]
                for env in self.worker_env(node, index, base)]

    def commands_for_release(self, keep: Sequence[str]) -> list[list[str]]:
        return []  # nothing to tell anybody: the processes are gone

    def start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> NodeHandle:
        """Run the command lines of commands_for_start, one process per device: forked from the fork
        server where it runs them as `python` would, else exactly those command lines."""
        procs = {}
        self.out.discard(node)
        server = forkserver.shared() if self.fork_server else None
        for env, cmd in zip(self.worker_env(node, index, base), self.commands_for_start(node, index, base, argv)):
            dev = int(env[ENV_DEVICE])
            log = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                log = self.log_dir / f"worker-dev{dev}.log"
            forked = server.spawn(resolve_python(argv), {**os.environ, **env}, None if log is None else str(log),
                                  name=f"elastic-dev{dev}") if server is not None else None
            if forked is not None:
                procs[dev] = forked
                continue
            out = None if log is None else open(log, "ab")
            procs[dev] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None)
            if out is not None:
                out.close()
        return NodeHandle(node, sorted(procs), procs=procs)

    def default_master_addr(self) -> str:
        return "127.0.0.1"

    def stop(self, handle: NodeHandle, timeout: float) -> bool:
        return stop_handle(handle, timeout)

    def signal(self, handle: NodeHandle, sig: int = signal_module.SIGTERM) -> None:
        handle.signal(sig)

    def release(self, keep: Sequence[str]) -> list[str]:
        self.released.append(list(keep))
        self.out |= set(self.names) - set(keep)
        return []

    def keep_rank(self, node: str) -> int:
        return 0

    def acquire(self, count: int, *, job_name: str, exclude: Sequence[str], timeout: float,
                report: Reporter, whole: bool = False) -> Acquired:
        raise CannotAcquire("the local backend cannot grow beyond it")

    def abandon(self, acquired: Acquired, why: str, report: Reporter) -> None:
        raise AssertionError("the local backend never acquires nodes")

    def close(self, report: Reporter) -> None:
        pass
