"""Read the cluster from Slurm itself: `sinfo --json`, `squeue --json`, `scontrol -o show reservation`.

Slurm 22.05 has no `scontrol --json`, and pyslurm for it is not installable, so this module runs
the commands and turns their output into plain frozen dataclasses. Parsing is separate from
running (the `parse_*` functions take the commands' text), so tests check it against recorded
output and against the real testbed. Read-only: it never changes anything in Slurm.

What it may import of launcher/: only the pure Slurm modules, launcher.backends.slurm.hostlist, .slurm_json,
.gres, .parse, .commands and .holdings (text in, values out, nothing run), so that Slurm's host
lists, GRES strings and job states are read by one piece of code for the launcher and the dashboard
alike. Nothing that runs Slurm commands, starts processes or talks to a job: the dashboard only
reads, and the launcher's client could change Slurm.
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from launcher.backends.slurm import hostlist
from launcher.backends.slurm.gres import gres_count, gres_indices
from launcher.backends.slurm.commands import build_sinfo_command, build_squeue_command
from launcher.backends.slurm.parse import HOLDING_STATES, parse_slurm_version
from launcher.backends.slurm.slurm_json import SlurmFormatError, job_records, json_format, node_records


class SlurmReadError(RuntimeError):
    """A Slurm command failed or printed something unreadable; the message says which and why."""


@dataclass(frozen=True)
class SlurmNode:
    """One node as sinfo reports it. `state` is the base state (idle, mixed, allocated, down, ...),
    `flags` the upper-case modifiers (DRAIN, RESERVED, MAINTENANCE, NOT_RESPONDING, ...)."""

    name: str
    partitions: tuple[str, ...]
    gpus: int
    state: str
    flags: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class SlurmJob:
    """A job holding resources. `gpus` maps node -> the GPU indices it holds there (IDX from
    squeue's gres_detail); `gpus_unknown` maps node -> a count when Slurm gave no indices."""

    job_id: str
    name: str
    user: str
    state: str
    partition: str
    gpus: Mapping[str, tuple[int, ...]]
    gpus_unknown: Mapping[str, int]
    batch_host: str = ""
    het_job_id: str = ""  # a heterogeneous job's component: the leader's id ("" for a plain job)
    het_job_offset: int = 0  # ... and its component number (what srun --het-group takes)


@dataclass(frozen=True)
class Reservation:
    name: str
    nodes: tuple[str, ...]
    state: str


@dataclass(frozen=True)
class SlurmSnapshot:
    nodes: tuple[SlurmNode, ...]
    jobs: tuple[SlurmJob, ...]
    reservations: tuple[Reservation, ...]

    @property
    def reserved_nodes(self) -> frozenset[str]:
        return frozenset(n for r in self.reservations if r.state == "ACTIVE" for n in r.nodes)


# ------------------------------------------------------------------------------ small parsers
def expand_hostlist(text: str) -> list[str]:
    """launcher.backends.slurm.hostlist.expand_hostlist, failing as this reader fails: a SlurmReadError."""
    try:
        return hostlist.expand_hostlist(text)
    except ValueError as exc:
        raise SlurmReadError(str(exc)) from None


def parse_sinfo(text: str) -> list[SlurmNode]:
    """`sinfo --json` of any release -> nodes, one per name (launcher.backends.slurm.slurm_json)."""
    try:
        records = node_records(text)
    except SlurmFormatError as exc:
        raise SlurmReadError(str(exc)) from None
    return [SlurmNode(n.name, n.partitions, gres_count(n.gres), n.state, n.flags, n.reason) for n in records]


def parse_squeue(text: str) -> list[SlurmJob]:
    """`squeue --json` of any release -> the jobs that hold resources, with the GPU indices they hold per node."""
    try:
        records = job_records(text)
    except SlurmFormatError as exc:
        raise SlurmReadError(str(exc)) from None
    jobs = []
    for j in records:
        if j.state not in HOLDING_STATES:
            continue
        names = list(j.allocated) or expand_hostlist(j.nodes)
        per_node = gres_count(j.tres_per_node)
        gpus: dict[str, tuple[int, ...]] = {}
        unknown: dict[str, int] = {}
        for i, node in enumerate(names):
            idx = gres_indices(j.gres_detail[i]) if i < len(j.gres_detail) else None
            if idx is None:
                if per_node:
                    unknown[node] = per_node
            elif idx:
                gpus[node] = idx
        jobs.append(SlurmJob(str(j.job_id), j.name, j.user, j.state, j.partition, gpus, unknown, j.batch_host,
                             str(j.het_job_id) if j.het_job_id else "", j.het_job_offset))
    return jobs


def parse_reservations(text: str) -> list[Reservation]:
    """`scontrol -o show reservation` (one line each) -> reservations with their expanded nodes."""
    out = []
    for line in text.splitlines():
        if not line.startswith("ReservationName="):
            continue
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        nodes = fields.get("Nodes", "")
        out.append(Reservation(fields["ReservationName"],
                               tuple(expand_hostlist(nodes)),
                               fields.get("State", "")))
    return out


# ------------------------------------------------------------------------------------ running
def _run(argv: Sequence[str], env: Mapping[str, str] | None, timeout: float) -> str:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except FileNotFoundError:
        raise SlurmReadError(f"{argv[0]} is not installed (no Slurm client on this machine)") from None
    except subprocess.TimeoutExpired:
        raise SlurmReadError(f"`{' '.join(argv)}` did not answer within {timeout:.0f} s") from None
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise SlurmReadError(f"`{' '.join(argv)}` failed ({proc.returncode}): {why[-1] if why else 'no message'}")
    return proc.stdout


_RELEASES: dict[str, tuple[int, int]] = {}  # SLURM_CONF -> the release its tools are, read once


def slurm_release(env: Mapping[str, str] | None, timeout: float) -> tuple[int, int]:
    """The Slurm release of the client tools (`scontrol --version`), read once per configuration."""
    key = (env or {}).get("SLURM_CONF") or os.environ.get("SLURM_CONF", "")
    if key not in _RELEASES:
        try:
            _RELEASES[key] = parse_slurm_version(_run(["scontrol", "--version"], env, timeout))
        except ValueError as exc:
            raise SlurmReadError(str(exc)) from None
    return _RELEASES[key]


def read_slurm(env: Mapping[str, str] | None = None, timeout: float = 10.0) -> SlurmSnapshot:
    """Ask Slurm now (short read-only commands, in the JSON format the release offers); SlurmReadError
    says what went wrong."""
    fmt = json_format(slurm_release(env, timeout))
    nodes = parse_sinfo(_run(build_sinfo_command(fmt), env, timeout))
    jobs = parse_squeue(_run(build_squeue_command(fmt=fmt), env, timeout))
    reservations = parse_reservations(_run(["scontrol", "-o", "show", "reservation"], env, timeout))
    return SlurmSnapshot(tuple(nodes), tuple(jobs), tuple(reservations))
