"""Read the cluster from Slurm itself: `sinfo --json`, `squeue --json`, `scontrol -o show reservation`.

Slurm 22.05 has no `scontrol --json`, and pyslurm for it is not installable, so this module runs
the commands and turns their output into plain frozen dataclasses. Parsing is separate from
running (the `parse_*` functions take the commands' text), so tests check it against recorded
output and against the real testbed. Read-only: it never changes anything in Slurm.

What it may import of launcher/: only the pure Slurm modules, launcher.backends.slurm.hostlist,
.gres, .parse, .commands and .holdings (text in, values out, nothing run), so that Slurm's host
lists, GRES strings and job states are read by one piece of code for the launcher and the dashboard
alike. Nothing that runs Slurm commands, starts processes or talks to a job: the dashboard only
reads, and the launcher's client could change Slurm.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from launcher.backends.slurm import hostlist
from launcher.backends.slurm.gres import gres_count, gres_indices
from launcher.backends.slurm.parse import HOLDING_STATES, state_str


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


def _load(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmReadError(f"{what} printed no JSON ({exc.msg} at line {exc.lineno})") from None
    errors = [e for e in data.get("errors") or [] if e]
    if errors:
        raise SlurmReadError(f"{what} reported: {errors[0]}")
    return data


def parse_sinfo(text: str) -> list[SlurmNode]:
    """`sinfo --json` -> nodes, one per name (sinfo lists a node once per partition on some versions)."""
    nodes: dict[str, SlurmNode] = {}
    for n in _load(text, "sinfo --json").get("nodes", []):
        name = n["name"]
        parts = tuple(n.get("partitions") or ())
        if name in nodes:
            parts = tuple(dict.fromkeys(nodes[name].partitions + parts))
        state = n.get("state") or "unknown"
        flags = list(n.get("state_flags") or ())
        if isinstance(state, list):  # newer Slurm: one list of base state and flags
            state, flags = (state[0] if state else "unknown"), list(state[1:]) + flags
        nodes[name] = SlurmNode(name, parts, gres_count(n.get("gres", "")), str(state).lower(),
                                tuple(str(f).upper() for f in flags), n.get("reason") or "")
    return list(nodes.values())


def parse_squeue(text: str) -> list[SlurmJob]:
    """`squeue --json` -> the jobs that hold resources, with the GPU indices they hold per node."""
    jobs = []
    for j in _load(text, "squeue --json").get("jobs", []):
        state = state_str(j.get("job_state"))
        if state not in HOLDING_STATES:
            continue
        alloc = (j.get("job_resources") or {}).get("allocated_nodes") or []
        names = [a["nodename"] for a in alloc] or expand_hostlist(j.get("nodes") or "")
        details = list(j.get("gres_detail") or [])
        per_node = gres_count((j.get("tres_per_node") or "").removeprefix("gres:"))
        gpus: dict[str, tuple[int, ...]] = {}
        unknown: dict[str, int] = {}
        for i, node in enumerate(names):
            idx = gres_indices(details[i]) if i < len(details) else None
            if idx is None:
                if per_node:
                    unknown[node] = per_node
            elif idx:
                gpus[node] = idx
        het = int(j.get("het_job_id") or 0)
        jobs.append(SlurmJob(str(j["job_id"]), j.get("name") or "", j.get("user_name") or "", state,
                             j.get("partition") or "", gpus, unknown, j.get("batch_host") or "",
                             str(het) if het else "", int(j.get("het_job_offset") or 0)))
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


def read_slurm(env: Mapping[str, str] | None = None, timeout: float = 10.0) -> SlurmSnapshot:
    """Ask Slurm now (three short read-only commands); SlurmReadError says what went wrong."""
    nodes = parse_sinfo(_run(["sinfo", "--json"], env, timeout))
    jobs = parse_squeue(_run(["squeue", "--json"], env, timeout))
    reservations = parse_reservations(_run(["scontrol", "-o", "show", "reservation"], env, timeout))
    return SlurmSnapshot(tuple(nodes), tuple(jobs), tuple(reservations))
