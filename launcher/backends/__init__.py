"""Node backends: where the workers run (`local` processes or `slurm` steps), behind one `NodeBackend`.

`make_backend` picks and checks one from the command line's choice; the launcher then only uses
the NodeBackend methods (launcher.backends.base).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from launcher.backends.base import (
    Acquired,
    AcquireFailed,
    CannotAcquire,
    NodeBackend,
    NodeHandle,
    Reporter,
    resolve_python,
    shell_line,
)
from launcher.errors import UsageError

__all__ = ["Acquired", "AcquireFailed", "CannotAcquire", "NodeBackend", "NodeHandle", "Reporter", "make_backend",
           "resolve_python", "shell_line"]


#: simulated devices the local backend takes at most (each one a worker process on this machine)
LOCAL_MAX_DEVICES = 512


def make_backend(kind: str, *, job_id: int | None, gpus_per_node: int, min_nodes: int, max_nodes: int,
                 local_nodes: int | None = None, log_dir: Path | None = None,
                 node_gpus: tuple[int, ...] = (), fork_server: bool = True) -> tuple[NodeBackend, str | None]:
    """(backend, Slurm job id or None) for `--backend kind` ("auto": slurm inside a Slurm job, else local).
    Bad choices are UsageErrors, raised before anything starts."""
    if job_id is None and os.environ.get("SLURM_JOB_ID", "").isdigit():
        job_id = int(os.environ["SLURM_JOB_ID"])
    if kind == "auto":
        kind = "slurm" if job_id else "local"
    if kind == "local":
        from launcher.backends.local import LocalNodes

        n = local_nodes or len(node_gpus) or max_nodes
        if n < min_nodes:
            raise UsageError(f"--local-nodes {n} is below the --nnodes minimum {min_nodes}")
        devices = sum(node_gpus) if node_gpus else n * gpus_per_node
        if devices > LOCAL_MAX_DEVICES:
            raise UsageError(f"the local backend runs one worker process per simulated device on this machine: "
                             f"{n} nodes with {devices} devices in all is more than {LOCAL_MAX_DEVICES}; give fewer "
                             "--local-nodes (or a lower --nnodes MAX) or --gpus-per-node")
        return LocalNodes(n, gpus_per_node, log_dir=log_dir, node_gpus=node_gpus, fork_server=fork_server), None
    if job_id is None:
        raise UsageError("--backend slurm needs a job: run inside an sbatch script or give --job-id")
    from launcher.backends.slurm import select as slurm_select
    from launcher.backends.slurm.client import SlurmError
    from launcher.backends.slurm.nodes import SlurmNodes

    client = slurm_select.select_backend()
    try:
        info = client.job_info(job_id)
        allocation = client.allocation(job_id)  # every component, GPUs per node
    except (SlurmError, ValueError) as exc:
        raise UsageError(f"unknown Slurm job {job_id}: {exc}") from None
    if info.state.upper() != "RUNNING":
        raise UsageError(f"Slurm job {job_id} is {info.state}, not running")
    if len(allocation.nodes) < min_nodes:
        raise UsageError(f"Slurm job {job_id} holds {len(allocation.nodes)} node(s), fewer than --nnodes minimum "
                         f"{min_nodes}")
    nodes = SlurmNodes(client, job_id, gpus_per_node, info=info, log_dir=log_dir, allocation=allocation,
                       no_kill=client.no_kill(job_id))
    if os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0"):  # a requeued run: are its GPUs still known?
        why = nodes.check_gres()
        if why is not None:
            print(f"[elastic-launch] Slurm refuses GPU requests in this requeued job ({why}): the workers' steps "
                  "start with --gres=none; each worker takes its GPU by its local rank", file=sys.stderr, flush=True)
    return nodes, str(job_id)
