"""The interface every node backend implements (`NodeBackend`), and the handle of a node's workers.

The launcher holds one backend and never asks which one: what differs between running workers
as local processes and as Slurm steps (how they start, how a node is given back, whether more
nodes can be had, which node must never go) is behind these methods. Each backend builds its
commands with pure functions first (`commands_for_start`, `commands_for_release`): that is
what `elastic-launch --dry-run` prints, and what `start`/`release` run.
"""
from __future__ import annotations

import shlex
import signal as signal_module
import subprocess
from pathlib import Path
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class CannotAcquire(Exception):
    """The backend has no way to get nodes beyond those it holds (the message says why)."""


class AcquireFailed(Exception):
    """Asking for more nodes was tried and failed; recorded as a failed migration."""


@dataclass(frozen=True)
class Reporter:
    """Where a backend says what it did: `log` for the launcher's log, `audit(action, text)` for
    the database's audit log (the backend does not know the database)."""

    log: Callable[[str], None]
    audit: Callable[[str, str], None]


@dataclass(frozen=True)
class Acquired:
    """Nodes a backend got beyond its allocation, ready to start workers on.

    `label` names them for messages ("companion job 17"); `token` is the backend's own handle
    (given back to `abandon`); `deadline` (time.monotonic) bounds how long their workers may take
    to register."""

    nodes: tuple[str, ...]
    label: str
    token: object
    deadline: float


def resolve_python(argv: Sequence[str]) -> list[str]:
    """`python ...` runs with this interpreter, so workers see the launcher's environment (venv)."""
    argv = list(argv)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def shell_line(cmd: Sequence[str]) -> str:
    """One argv as a line a shell runs unchanged."""
    return " ".join(shlex.quote(c) for c in cmd)


class NodeHandle:
    """The workers of one node: per-device processes (local) or one srun step (Slurm)."""

    def __init__(self, node: str, devices: list[int], procs: dict[int, subprocess.Popen] | None = None,
                 step: subprocess.Popen | None = None) -> None:
        self.node, self.devices, self.procs, self.step = node, devices, procs or {}, step
        self.task_exits: dict[int, int] = {}  # device -> exit status of a step's task that ended early
        self.reader: threading.Thread | None = None  # reads srun's report into task_exits (Slurm)

    def _all(self) -> list[subprocess.Popen]:
        return ([self.step] if self.step else []) + list(self.procs.values())

    def exited(self) -> dict[int, int]:
        """device -> exit code, for the devices whose worker has ended."""
        if self.step is not None:
            rc = self.step.poll()
            if rc is None:
                return dict(self.task_exits)
            if self.reader is not None:
                self.reader.join(timeout=2)  # srun's last lines about its tasks
            # srun exits with its worst task's status and names every task that ended badly: when a
            # reported task explains that status, the tasks it did not name ended cleanly (a worker
            # that finished its steps after another task of its node was killed is not a death)
            rest = 0 if rc != 0 and rc in self.task_exits.values() else rc
            return {d: self.task_exits.get(d, rest) for d in self.devices}
        return {d: p.returncode for d, p in self.procs.items() if p.poll() is not None}

    def all_exited(self) -> bool:
        return len(self.exited()) == len(self.devices)

    def signal(self, sig: int = signal_module.SIGTERM) -> None:
        """Send `sig` to the node's workers (srun forwards it to every task of its step)."""
        for p in self._all():
            if p.poll() is None:
                p.send_signal(sig)

    def kill(self) -> None:
        for p in self._all():
            if p.poll() is None:
                p.kill()
        for p in self._all():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every worker to end; True when they all did."""
        deadline = time.monotonic() + timeout
        while not self.all_exited() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.all_exited()

    def kill_device(self, device: int) -> None:
        """Fault injection for tests and demos (local backend only)."""
        self.procs[device].kill()


@runtime_checkable
class NodeBackend(Protocol):
    """Where the launcher starts a node's workers, and how it gets and gives back nodes."""

    gpus_per_node: int
    # True when a released node may be started again (local); Slurm never returns released nodes
    released_nodes_return: bool

    @property
    def batch_node(self) -> str:
        """The node that runs the launcher: pinned, never given back."""

    def allocation(self) -> list[str]:
        """The nodes held now, the batch node first."""

    def gpus_on(self, node: str) -> int:
        """GPUs (workers) of `node`; nodes may differ (uneven nodes)."""

    def component_of(self, node: str) -> int:
        """The heterogeneous job's component `node` belongs to (Slurm's het-job offset, what
        `srun --het-group` takes; a companion job's nodes: the component it extends); 0 for a plain job
        and the local backend. Recorded with every rank."""

    def holds(self, node: str) -> bool:
        """True while the job holds `node`: after `release`, a node Slurm would not let go (a
        heterogeneous job's leader component) is still held, idle."""

    def describe(self) -> str:
        """One line for logs and the dry run."""

    def default_master_addr(self) -> str:
        """The address workers reach the control plane on, unless --master-addr says otherwise."""

    def commands_for_start(self, node: str, index: int, base: Mapping[str, str],
                           argv: Sequence[str]) -> list[list[str]]:
        """Pure: the command lines `start` runs for `node` (index `index` in the topology)."""

    def commands_for_release(self, keep: Sequence[str]) -> list[list[str]]:
        """Pure: the command lines `release(keep)` runs (none when nothing has to be told)."""

    def start(self, node: str, index: int, base: Mapping[str, str], argv: Sequence[str]) -> NodeHandle:
        """Start the workers of `node` with environment `base` (plus the per-node/device variables)."""

    def stop(self, handle: NodeHandle, timeout: float) -> bool:
        """Let the node's workers end on their own within `timeout` s, then kill them; True if they ended."""

    def signal(self, handle: NodeHandle, sig: int) -> None:
        """Send `sig` to the node's workers."""

    def release(self, keep: Sequence[str]) -> list[str]:
        """Give back every held node not in `keep`; returns what else ended with them, for the
        migration's message and the audit log (e.g. "companion job 17 cancelled")."""

    def keep_rank(self, node: str) -> int:
        """Order in which nodes are kept on a shrink (lower first): nodes that are cheap to give
        back (e.g. a companion job's non-batch nodes) rank higher."""

    def acquire(self, count: int, *, job_name: str, exclude: Sequence[str], timeout: float,
                report: Reporter, whole: bool = False) -> Acquired:
        """Get `count` more nodes (none of `exclude`) within `timeout` s; `whole`: nodes no other job uses
        (a grow of --policy opportunistic, which counts whole idle nodes).
        Raises CannotAcquire (no way to) or AcquireFailed (tried, failed; already cleaned up)."""

    def abandon(self, acquired: Acquired, why: str, report: Reporter) -> None:
        """Give back nodes from `acquire` that the job did not move onto."""

    def close(self, report: Reporter) -> None:
        """The launcher exits: give back whatever `acquire` got."""

    def output_files(self, node: str, devices: Sequence[int]) -> list[Path]:
        """Where the output of these workers of `node` goes (none: to elastic-launch's own), for error messages."""

    # why the loss of one node ends the whole job whatever its layout (e.g. a Slurm job without --no-kill), or None
    node_loss_ends_job: str | None

    # a collective failed and no worker is seen ending (launcher.loop.probe): was a whole node lost?
    probe_s: float  # how long checking nodes may take, at most (the workers wait that long for the answer)

    def unreachable(self, nodes: Sequence[str], steps: bool = True) -> dict[str, str]:
        """Which of `nodes` are gone (crashed, powered off, cut off), each with what showed it; {} when the
        backend sees every worker's end itself (local processes). steps=False: the cluster's word only, nothing
        started on the nodes (cheap enough to ask every few seconds)."""

    def draining(self, nodes: Sequence[str]) -> dict[str, str]:
        """Which of `nodes` the cluster drains (an admin takes them out of service), each with what it says;
        the launcher leaves them by a live shrink (launcher.loop.drain). {} where nothing drains nodes."""

    def cluster_view(self):
        """What the cluster says of the job's partition now, for --policy opportunistic
        (launcher.policy.opportunistic.ClusterView: idle nodes, jobs pending there, the job's own left out);
        None where there is no cluster to read or it did not answer."""

    def announce(self, mark: str) -> None:
        """Tell the cluster's other users what this job is (launcher.policy.peers.policy_mark: its policy and
        node range), where every elastic job's policy reads it; nothing where there is no one to tell."""

    successor: object  # the job queued to take this one over if the batch node is lost (None: none)

    def queue_successor(self, job_name: str, min_nodes: int, max_nodes: int):
        """Queue a successor that resumes the job from its safety checkpoint if the batch node (with the
        launcher) is lost (launcher.backends.slurm.successor); its id, or None where the backend has none."""

    def keep_successor(self) -> str | None:
        """Called every poll: hold the successor back while this launcher lives; what is worth saying, or None."""

    def takeover_reason(self, predecessor: str) -> str | None:
        """In a successor: why it may take over from Slurm job `predecessor` now (what is left of it cancelled),
        or None while that job's launcher may be alive."""

    def forget(self, node: str) -> list[str]:
        """`node` is gone: never start workers there again, take it out of the allocation as far as the
        cluster lets (Slurm may have done so itself); returns notes for the log and audit."""


def stop_handle(handle: NodeHandle, timeout: float) -> bool:
    """The common `NodeBackend.stop`: wait for the workers to end, kill them after `timeout` s."""
    if handle.wait(timeout):
        return True
    handle.kill()
    return False
