"""What a Slurm job holds, node by node: GPUs per node and, for a heterogeneous job, the component.

Why a reader of its own: `SLURM_JOB_NODELIST` and `SLURM_GPUS_ON_NODE` describe only the batch
node's component and one GPU count, and never change after a resize. Slurm 22.05 says the rest in
two places, read here into the same frozen dataclasses:

- `scontrol show job -d <leader>`: one record per component (`HetJobId=`, `HetJobOffset=`), each
  with detail lines `Nodes=n[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:4(IDX:0-3)` (nodes with equal
  shares are grouped, so a plain job on uneven nodes shows one line per share);
- `squeue --json`: one entry per component (`het_job_id`, `het_job_offset`) with `gres_detail`,
  one string per node in the order of `job_resources.allocated_nodes`. 22.05 ignores `--jobs`
  with `--json`, so the entries are picked here.

A component that ended (e.g. released with `scancel <component job id>`) still shows its old
NodeList; it holds nothing, so it is left out. Offsets are kept as Slurm numbers them, because
`srun --het-group=<offset>` addresses a component by them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from launcher.backends.slurm.gres import gres_count
from launcher.backends.slurm.hostlist import expand_hostlist
from launcher.backends.slurm.parse import HOLDING_STATES, parse_key_values
from launcher.backends.slurm.slurm_json import job_records

_DETAIL = re.compile(r"^\s+Nodes=(?P<nodes>\S+)\s")
_DETAIL_GRES = re.compile(r"\sGRES=(?P<gres>\S*)")


@dataclass(frozen=True)
class Component:
    """One component of a job (a plain job is one component, offset 0).

    `job_id` is the component's own id (leader + offset on 22.05): `scontrol update JobId=` and
    `scancel` take it, while `srun` must name the leader and `--het-group=offset`.
    """

    offset: int
    job_id: int
    nodes: tuple[str, ...]
    gpus: tuple[int, ...]  # per node, in `nodes` order
    partition: str = ""
    batch_host: str | None = None

    def __post_init__(self) -> None:
        if len(self.nodes) != len(self.gpus):
            raise ValueError(f"component {self.offset}: {len(self.nodes)} nodes but {len(self.gpus)} GPU counts")


@dataclass(frozen=True)
class Allocation:
    """The nodes a job holds now, grouped by component; `job_id` is the job's (leader's) id."""

    job_id: int
    components: tuple[Component, ...]

    @property
    def heterogeneous(self) -> bool:
        return len(self.components) > 1 or any(c.offset for c in self.components)

    @property
    def batch_host(self) -> str | None:
        """The node running the batch script: the leader's (component 0) batch host."""
        leader = [c for c in self.components if c.offset == 0]
        return leader[0].batch_host if leader else None

    @property
    def nodes(self) -> list[str]:
        """Every node held, component by component."""
        return [n for c in self.components for n in c.nodes]

    def gpus(self) -> dict[str, int]:
        """Node -> GPUs this job holds on it."""
        return {n: g for c in self.components for n, g in zip(c.nodes, c.gpus)}

    def component_of(self, node: str) -> Component:
        for c in self.components:
            if node in c.nodes:
                return c
        raise KeyError(f"node {node} is not in job {self.job_id}'s allocation")

    def component(self, offset: int) -> Component:
        for c in self.components:
            if c.offset == offset:
                return c
        raise KeyError(f"job {self.job_id} has no running component {offset}")


def _records(text: str) -> list[str]:
    """`scontrol show job` prints one record per component, each starting with `JobId=`."""
    starts = [m.start() for m in re.finditer(r"^JobId=", text, flags=re.M)]
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def parse_show_job_detail(text: str) -> Allocation:
    """`scontrol show job -d JOB` (any component's id or the leader's) -> Allocation."""
    components: list[Component] = []
    leader: int | None = None
    for record in _records(text):
        fields = parse_key_values(record)
        job_id = int(fields["JobId"])
        het = fields.get("HetJobId")
        leader = int(het) if het and het.isdigit() else job_id if leader is None else leader
        if fields.get("JobState", "") not in HOLDING_STATES:
            continue
        share: dict[str, int] = {}
        for line in record.splitlines():
            m = _DETAIL.match(line)
            if m:
                gres = _DETAIL_GRES.search(line)
                for node in expand_hostlist(m["nodes"]):
                    share[node] = gres_count(gres["gres"] if gres else "")
        nodes = expand_hostlist(fields.get("NodeList", ""))
        batch = fields.get("BatchHost") or None
        components.append(Component(
            offset=int(fields.get("HetJobOffset", "0") or 0), job_id=job_id, nodes=tuple(nodes),
            gpus=tuple(share.get(n, 0) for n in nodes), partition=fields.get("Partition", ""),
            batch_host=None if batch in (None, "(null)") else batch))
    if leader is None:
        raise ValueError(f"no JobId in scontrol output: {text[:200]!r}")
    return Allocation(leader, tuple(sorted(components, key=lambda c: c.offset)))


def parse_squeue_allocation(text: str, job_id: int) -> Allocation:
    """`squeue --json` (any release) -> the Allocation of job `job_id` (a leader's or a plain job's id)."""
    entries = [j for j in job_records(text) if (j.het_job_id or j.job_id) == job_id]
    if not entries:
        raise ValueError(f"job {job_id} is not in the squeue output")
    components = []
    for job in entries:
        if job.state not in HOLDING_STATES:
            continue
        nodes = list(job.allocated) or expand_hostlist(job.nodes)
        detail = job.gres_detail
        components.append(Component(
            offset=job.het_job_offset, job_id=job.job_id, nodes=tuple(nodes),
            gpus=tuple(gres_count(detail[i]) if i < len(detail) else 0 for i in range(len(nodes))),
            partition=job.partition, batch_host=job.batch_host or None))
    return Allocation(job_id, tuple(sorted(components, key=lambda c: c.offset)))
