"""`squeue --json` and `sinfo --json` of every Slurm release, read into one plain shape.

Why a layer of its own: Slurm's JSON changed under its readers. 22.05 (data_parser v0.0.38) prints
numbers as numbers, states as strings and `sinfo` as a list of nodes; 23.02 and later (v0.0.39 on,
measured on 24.11's v0.0.40-42 and 26.05's v0.0.42-45) print numbers as {"set", "infinite", "number"},
states as lists of flags, allocations as job_resources.nodes.allocation and `sinfo` as grouped
records ({"sinfo": [{"nodes": {"nodes": [...]}, "partition": {"name": ...}, ...}]}). Each release
offers several formats; the client asks for a named one where the release has it (`json_format`),
so one site's upgrade does not change what this reads.

Everything here is pure: text in, plain records (`JobRecord`, `NodeRecord`) out. A field of a shape
it does not know is an error that names the Slurm release and the field (`SlurmFormatError`), never
a silent zero or an empty list.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: the newest data_parser format each release offers that this module reads, by (major, minor);
#: 22.05 has no named formats (plain `--json`)
NAMED_FORMATS = ((23, 2, "v0.0.39"), (23, 11, "v0.0.40"), (24, 5, "v0.0.41"), (24, 11, "v0.0.42"))


class SlurmFormatError(ValueError):
    """Slurm printed JSON of a shape this launcher does not read; the message names the release and field."""


def json_format(release: tuple[int, int] | None) -> str | None:
    """The format to ask for (`squeue --json=v0.0.42`) on Slurm `release`, None for plain `--json`."""
    if release is None:
        return None
    chosen = None
    for major, minor, fmt in NAMED_FORMATS:
        if release >= (major, minor):
            chosen = fmt
    return chosen


@dataclass(frozen=True)
class JobRecord:
    """One job (or heterogeneous component) of `squeue --json`, in plain values."""

    job_id: int
    state: str  # the base state, RUNNING, PENDING, ...
    nodes: str  # Slurm's host list, e.g. n[1-2]
    allocated: tuple[str, ...]  # the nodes of job_resources, in allocation order (empty when none)
    batch_host: str
    node_count: int
    name: str
    reason: str
    partition: str
    comment: str
    priority: int
    submit_time: int
    het_job_id: int  # 0 for a plain job
    het_job_offset: int
    gres_detail: tuple[str, ...]  # per allocated node, e.g. gpu:2(IDX:0-1)
    tres_per_node: str  # gres without its prefix, e.g. gpu:2
    user: str


@dataclass(frozen=True)
class NodeRecord:
    """One node of `sinfo --json` (a node listed once per partition is merged into one)."""

    name: str
    state: str  # lower case base state: idle, mixed, allocated, down, ...
    flags: tuple[str, ...]  # upper case: DRAIN, RESERVED, NOT_RESPONDING, ...
    cpus: int
    gres: str
    partitions: tuple[str, ...]
    reason: str


class _Reader:
    """Field access that fails with the release and the field's path."""

    def __init__(self, what: str, release: str) -> None:
        self.what, self.release = what, release

    def fail(self, path: str, value: Any) -> SlurmFormatError:
        return SlurmFormatError(
            f"`{self.what}` of Slurm {self.release}: field {path} is {str(value)[:80]!r}, a shape this launcher "
            "does not read; tell the launcher's maintainers the Slurm release (`scontrol --version`)")

    def number(self, value: Any, path: str) -> int:
        """22.05's plain numbers and v0.0.39+'s {"set", "infinite", "number"} (unset or infinite: 0)."""
        if value is None or value == "":
            return 0
        if isinstance(value, bool):
            raise self.fail(path, value)
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.isdigit():
            return int(value)
        if isinstance(value, dict) and {"set", "number"} <= set(value):
            return int(value["number"]) if value["set"] and not value.get("infinite") else 0
        raise self.fail(path, value)

    def text(self, value: Any, path: str) -> str:
        if value is None:
            return ""
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
        raise self.fail(path, value)

    def states(self, value: Any, path: str) -> tuple[str, tuple[str, ...]]:
        """('RUNNING', ()) from 'RUNNING' (22.05) or ['RUNNING'] / ['IDLE', 'DRAIN'] (newer)."""
        if isinstance(value, str):
            return value, ()
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return (value[0], tuple(value[1:])) if value else ("UNKNOWN", ())
        raise self.fail(path, value)

    def strings(self, value: Any, path: str) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        if isinstance(value, str):  # some releases print a comma-separated string
            return tuple(p for p in value.split(",") if p)
        raise self.fail(path, value)

    def mapping(self, value: Any, path: str) -> dict[str, Any]:
        if value is None:
            return {}
        if isinstance(value, dict):
            return value
        raise self.fail(path, value)

    def records(self, data: dict[str, Any], key: str) -> list[dict[str, Any]]:
        if key not in data:
            raise self.fail(key, f"missing (top-level keys: {', '.join(sorted(data))})")
        value = data[key]
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise self.fail(key, value)
        return value


def release_of(data: dict[str, Any]) -> str:
    """The release the JSON says printed it (v0.0.39+: meta.slurm.release; 22.05: meta.Slurm.release)."""
    meta = data.get("meta") or {}
    for key in ("slurm", "Slurm"):
        slurm = meta.get(key) if isinstance(meta, dict) else None
        if isinstance(slurm, dict):
            if slurm.get("release"):
                return str(slurm["release"])
            version = slurm.get("version") or {}
            if isinstance(version, dict) and version.get("major") is not None:
                return f"{version.get('major')}.{version.get('minor')}"
    return "(release not printed)"


def load(text: str, what: str) -> tuple[dict[str, Any], _Reader]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmFormatError(f"`{what}` did not print JSON ({exc.msg} at line {exc.lineno}); "
                               f"output starts {text[:120]!r}") from None
    if not isinstance(data, dict):
        raise SlurmFormatError(f"`{what}` printed JSON that is not an object")
    reader = _Reader(what, release_of(data))
    errors = [e for e in data.get("errors") or [] if e]
    if errors:
        first = errors[0]
        message = first.get("description") or first.get("error") if isinstance(first, dict) else first
        raise SlurmFormatError(f"`{what}` of Slurm {reader.release} reported: {message}")
    return data, reader


def job_records(text: str) -> list[JobRecord]:
    """Every entry of `squeue --json` (any release)."""
    data, r = load(text, "squeue --json")
    out = []
    for i, job in enumerate(r.records(data, "jobs")):
        at = f"jobs[{i}]."
        resources = r.mapping(job.get("job_resources"), at + "job_resources")
        if "allocated_nodes" in resources:  # 22.05
            allocated = tuple(r.text(n.get("nodename"), at + "job_resources.allocated_nodes[].nodename")
                              for n in resources["allocated_nodes"] or [])
        else:  # v0.0.40+: job_resources.nodes.allocation[].name
            nodes = r.mapping(resources.get("nodes"), at + "job_resources.nodes")
            allocation = nodes.get("allocation") or []
            if not isinstance(allocation, list):
                raise r.fail(at + "job_resources.nodes.allocation", allocation)
            allocated = tuple(r.text(n.get("name"), at + "job_resources.nodes.allocation[].name") for n in allocation)
        if "job_id" not in job:
            raise r.fail(at + "job_id", "missing")
        state, _ = r.states(job.get("job_state", "UNKNOWN"), at + "job_state")
        out.append(JobRecord(
            job_id=r.number(job["job_id"], at + "job_id"), state=state,
            nodes=r.text(job.get("nodes"), at + "nodes"), allocated=allocated,
            batch_host=r.text(job.get("batch_host"), at + "batch_host"),
            node_count=r.number(job.get("node_count"), at + "node_count"),
            name=r.text(job.get("name"), at + "name"), reason=r.text(job.get("state_reason"), at + "state_reason"),
            partition=r.text(job.get("partition"), at + "partition"),
            comment=r.text(job.get("comment"), at + "comment"),
            priority=r.number(job.get("priority"), at + "priority"),
            submit_time=r.number(job.get("submit_time"), at + "submit_time"),
            het_job_id=r.number(job.get("het_job_id"), at + "het_job_id"),
            het_job_offset=r.number(job.get("het_job_offset"), at + "het_job_offset"),
            gres_detail=r.strings(job.get("gres_detail"), at + "gres_detail"),
            tres_per_node=_without_gres_prefix(r.text(job.get("tres_per_node"), at + "tres_per_node")),
            user=r.text(job.get("user_name"), at + "user_name"),
        ))
    return out


def _without_gres_prefix(tres: str) -> str:
    """'gres:gpu:4' (22.05) and 'gres/gpu:2' (newer) -> 'gpu:4', 'gpu:2'."""
    return ",".join(p.removeprefix("gres:").removeprefix("gres/") for p in tres.split(",")) if tres else ""


def node_records(text: str) -> list[NodeRecord]:
    """Every node of `sinfo --json` (any release), once each, with all its partitions."""
    data, r = load(text, "sinfo --json")
    nodes: dict[str, NodeRecord] = {}
    if "nodes" in data and "sinfo" not in data:  # 22.05: one entry per node (and partition)
        for i, n in enumerate(r.records(data, "nodes")):
            at = f"nodes[{i}]."
            state, flags = r.states(n.get("state", "unknown"), at + "state")
            flags += r.strings(n.get("state_flags"), at + "state_flags")
            reason = n.get("reason")
            _merge(nodes, NodeRecord(
                r.text(n.get("name"), at + "name"), state.lower(), tuple(f.upper() for f in flags),
                r.number(n.get("cpus"), at + "cpus"), r.text(n.get("gres"), at + "gres"),
                r.strings(n.get("partitions"), at + "partitions"),
                r.text(reason.get("description") if isinstance(reason, dict) else reason, at + "reason")))
        return list(nodes.values())
    for i, rec in enumerate(r.records(data, "sinfo")):  # v0.0.40+: grouped records
        at = f"sinfo[{i}]."
        state, flags = r.states(r.mapping(rec.get("node"), at + "node").get("state"), at + "node.state")
        names = r.strings(r.mapping(rec.get("nodes"), at + "nodes").get("nodes"), at + "nodes.nodes")
        cpus = r.mapping(rec.get("cpus"), at + "cpus")
        partition = r.text(r.mapping(rec.get("partition"), at + "partition").get("name"), at + "partition.name")
        reason = r.mapping(rec.get("reason"), at + "reason") if isinstance(rec.get("reason"), dict) else \
            {"description": rec.get("reason")}
        for name in names:
            _merge(nodes, NodeRecord(
                name, state.lower(), tuple(f.upper() for f in flags),
                r.number(cpus.get("minimum", cpus.get("total")), at + "cpus.minimum"),
                r.text(r.mapping(rec.get("gres"), at + "gres").get("total"), at + "gres.total"),
                (partition,) if partition else (), r.text(reason.get("description"), at + "reason.description")))
    return sorted(nodes.values(), key=lambda n: _natural(n.name))  # records group nodes by state: n1, n3, n2


def _natural(name: str) -> tuple:
    """n2 before n10."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _merge(nodes: dict[str, NodeRecord], node: NodeRecord) -> None:
    """A node listed once per partition keeps every partition, in order."""
    seen = nodes.get(node.name)
    if seen is not None:
        node = NodeRecord(node.name, node.state, node.flags, node.cpus, node.gres,
                          tuple(dict.fromkeys(seen.partitions + node.partitions)), node.reason)
    nodes[node.name] = node
