"""A training script written for `srun python srun_script.py`: its ranks and world come from SLURM_* alone.

    srun_script.py --log FILE [--sleep-while PATH]

Every task appends one JSON line to FILE: the SLURM_* variables a srun-launched script reads, what
Lightning's SLURMEnvironment makes of them (when lightning_fabric imports; its validate_settings must
accept them), and the ranks every task of the world reported in an all_gather -- so a world of
duplicate ranks or of the wrong size cannot pass unnoticed (the process group would not form).
Then it trains a few steps of a tiny model, more while PATH exists, and ends.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

KEYS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
        "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
        "SLURM_NODELIST", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_GTIDS", "SLURMD_NODENAME")


def lightning_view(local_tasks: int, nodes: int) -> dict | None:
    try:
        from lightning_fabric.plugins.environments import SLURMEnvironment
    except ImportError:
        return None
    env = SLURMEnvironment()
    env.validate_settings(num_devices=local_tasks, num_nodes=nodes)  # raises on a contract Lightning rejects
    return {"detect": SLURMEnvironment.detect(), "world_size": env.world_size(), "global_rank": env.global_rank(),
            "local_rank": env.local_rank(), "node_rank": env.node_rank()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--log", required=True)
    p.add_argument("--sleep-while", default=None)
    args = p.parse_args()
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    nodes = int(os.environ["SLURM_NNODES"])
    local_tasks = len(os.environ["SLURM_GTIDS"].split(","))
    seen = {k: os.environ.get(k) for k in KEYS}
    lightning = lightning_view(local_tasks, nodes)
    peers: list[int] = []
    if "MASTER_ADDR" in os.environ:  # under elastic-launch (a bare srun oracle run has no rendezvous)
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
        gathered = [None] * world
        dist.all_gather_object(gathered, rank)
        peers = sorted(gathered)
    with open(args.log, "a") as f:  # before training: a resize stops this world while it trains
        f.write(json.dumps({"env": seen, "lightning": lightning, "peers": peers,
                            "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")}) + "\n")
    if peers:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = 0
        while step < 3 or (args.sleep_while and os.path.exists(args.sleep_while)):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
            opt.step()
            step += 1
            time.sleep(0.2)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
