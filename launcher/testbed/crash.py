"""A node crash on the testbed: what a powered-off, rebooted or unplugged node looks like to Slurm and
to the job, on one host where every "node" is a `slurmd -N nX` process.

A real crash takes the node's slurmd, every slurmstepd on it and every task they run at the same
instant. Here those are found in /proc: the tasks carry SLURMD_NODENAME=<node> (slurmstepd sets it), and
their slurmstepd is the nearest ancestor whose program is slurmstepd. Everything is killed with SIGKILL,
slurmd first, so nothing on the node can tell slurmctld or srun that its tasks ended.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

PROC = Path("/proc")


def _environ(pid: int) -> dict[bytes, bytes]:
    raw = (PROC / str(pid) / "environ").read_bytes()
    return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def _parent(pid: int) -> int:
    stat = (PROC / str(pid) / "stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _is_stepd(pid: int) -> bool:
    try:
        return os.path.basename(os.readlink(PROC / str(pid) / "exe")).startswith("slurmstepd")  # Debian: -wlm
    except OSError:
        return False


def node_processes(node: str) -> tuple[list[int], list[int]]:
    """(slurmstepd pids, task pids) of `node`: every process whose environment says it runs on `node`,
    and the slurmstepd above each."""
    want = node.encode()
    tasks, stepds = [], set()
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            if _environ(pid).get(b"SLURMD_NODENAME") != want:
                continue
            tasks.append(pid)
            up = _parent(pid)
            while up > 1 and not _is_stepd(up):
                up = _parent(up)
            if up > 1:
                stepds.add(up)
        except (OSError, ValueError, IndexError):  # ended while we looked
            continue
    return sorted(stepds), sorted(set(tasks) - stepds)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
