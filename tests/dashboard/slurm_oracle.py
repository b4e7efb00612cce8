"""What Slurm itself says of a job, read from `scontrol`'s text with a regular expression of its own: the
oracle the cluster-view tests hold the dashboard's JSON reading against (it shares no code with it)."""
from __future__ import annotations

import os
import re
import subprocess


def slurm(env: dict[str, str], *argv: str) -> str:
    """Run a Slurm command with the testbed's environment; its stdout (an error fails the test)."""
    return subprocess.run(list(argv), env={**os.environ, **env}, capture_output=True, text=True, check=True,
                          timeout=30).stdout


def gpu_indices(env: dict[str, str], job: str) -> dict[str, tuple[int, ...]]:
    """node -> the GPU indices `job` holds there, from `scontrol -d show job` lines like `Nodes=n2 CPU_IDs=0
    Mem=0 GRES=gpu:1(IDX:0)`; of a heterogeneous job's component, its own record only (scontrol prints every
    component's, each from `JobId=`)."""
    out: dict[str, tuple[int, ...]] = {}
    records = re.split(r"(?m)^(?=JobId=)", slurm(env, "scontrol", "-d", "show", "job", job))
    (record,) = [r for r in records if r.startswith(f"JobId={job} ")]
    for nodes, idx in re.findall(r"Nodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=gpu:\d+\(IDX:([\d,\-]+)\)", record):
        gpus = tuple(g for part in idx.split(",") for g in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))
        for node in slurm(env, "scontrol", "show", "hostnames", nodes).split():
            out[node] = gpus
    return out
