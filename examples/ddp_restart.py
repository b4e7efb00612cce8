"""A plain DistributedDataParallel script, run by elastic-launch in RESTART mode (torchrun's contract).

Nothing here knows about elastic-launch: it reads torchrun's variables through `init_process_group`
(env://), checkpoints model and optimizer with torch.distributed.checkpoint (DCP) every
`--ckpt-every` steps, and resumes from the newest complete checkpoint when it starts. When the job
is resized, preempted or a worker fails, the launcher stops every worker (SIGTERM, then SIGKILL
after --term-timeout) and starts the new world on the new node set; this script then simply
resumes, losing at most the steps since its last checkpoint; with `--save-on-term` it checkpoints
when SIGTERM comes (every rank at the same step) and loses none.

    elastic-launch --backend local --nnodes 1:2 --gpus-per-node 1 -- \\
        python examples/ddp_restart.py --steps 50 --ckpt-dir /tmp/ddp-ckpt --log /tmp/ddp.log

The data of step s is a function of s alone (seeded), split over the ranks, so the global batch and
the loss curve do not depend on how many workers there are.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50, help="train until this step (default 50)")
    p.add_argument("--ckpt-every", type=int, default=2, help="checkpoint every N steps (default 2)")
    p.add_argument("--ckpt-dir", type=Path, required=True, help="folder of the checkpoints (step-<S>)")
    p.add_argument("--log", type=Path, default=None,
                   help="rank 0 appends `step loss world restart` here, once the step (and its checkpoint) is done")
    p.add_argument("--global-batch", type=int, default=8, help="samples per step over all ranks (default 8)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step (demos)")
    p.add_argument("--sleep-while", type=Path, default=None,
                   help="sleep after a step only while this file exists (a test removes it once it has resized "
                        "the job, and the last steps run at full speed)")
    p.add_argument("--save-on-term", action="store_true",
                   help="on SIGTERM, checkpoint at the next step boundary (all ranks agree on it) and exit")
    return p.parse_args()


def batch(step: int, global_batch: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step `step`'s global batch (the same global batch at any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, 16, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    per = global_batch // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def latest(root: Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint folder (step-<S>) under root."""
    done = [(p, int(p.name[5:])) for p in root.glob("step-*") if p.name[5:].isdigit()] if root.is_dir() else []
    return max(done, key=lambda t: t[1]) if done else None


def save(model, opt, step: int, root: Path, rank: int) -> None:
    """A DCP checkpoint of model, optimizer and step, published whole as root/step-<step>."""
    msd, osd = get_state_dict(model, opt)
    tmp = root / f".tmp-step-{step}"
    dcp.save({"model": msd, "optim": osd, "step": step}, checkpoint_id=str(tmp))
    dist.barrier()  # every rank's part is written
    if rank == 0:  # publish it whole, then drop older ones
        os.replace(tmp, root / f"step-{step}")
        for old in root.glob("step-*"):
            if old.name[5:].isdigit() and int(old.name[5:]) < step:
                shutil.rmtree(old, ignore_errors=True)


def stop_agreed(terms: list[int]) -> bool:
    """True on every rank when any rank got SIGTERM: the ranks get it at slightly different times, so
    they agree on the step to stop at with one all-reduce (MAX) per step."""
    flag = torch.tensor([1 if terms else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    terms: list[int] = []
    if args.save_on_term:  # the launcher's SIGTERM (torchrun's contract): note it, act at a step boundary
        signal.signal(signal.SIGTERM, lambda *_: terms.append(1))
    step, stop = 0, False
    found = latest(args.ckpt_dir)
    if found:  # resume: model, optimizer and step from the newest complete checkpoint
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, checkpoint_id=str(found[0]))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from {found[0]} at step {step} (world {world}, restart {restart})", flush=True)
    while step < args.steps:
        x, y = batch(step, args.global_batch, rank, world)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        total = loss.detach().clone()
        dist.all_reduce(total)
        stop = args.save_on_term and stop_agreed(terms)
        if step % args.ckpt_every == 0 or stop:
            save(model, opt, step, args.ckpt_dir, rank)
        if rank == 0 and args.log:  # after the step's checkpoint: a logged checkpoint step survives a restart
            with open(args.log, "a") as f:
                f.write(f"{step} {total.item() / world:.6f} {world} {restart}\n")
        if stop:
            if rank == 0:
                print(f"SIGTERM: checkpointed step {step}, exiting", flush=True)
            break
        if args.step_sleep and (args.sleep_while is None or args.sleep_while.exists()):
            time.sleep(args.step_sleep)
    dist.barrier()
    dist.destroy_process_group()
    end_now()


def end_now() -> None:
    """Done, or stopped by the launcher with the checkpoint written: exit at once, skipping the
    interpreter's teardown. Nothing is left to do, and the teardown costs and risks: it takes ~0.6 s
    of CPU per process (a full garbage collection over its objects, then every module), seconds for
    the workers of a node sharing its cores, and the launcher starts a new world only once every
    worker has ended (measured on the testbed: 2-4.5 s of each restart's stop phase with 4-8
    workers); and the DDP module still holds the process group, whose gloo threads, destroyed that
    late, once aborted a worker after its last step (exit 134, "terminate called without an active
    exception"), which the launcher rightly took for a failure and restarted the job."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
