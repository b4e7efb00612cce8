"""A stack of MLP blocks in LIVE mode with PIPELINE parallelism (plus DP, optionally TP): each rank
builds only its stage, torch.distributed.pipelining runs the microbatches (GPipe on gloo), and
elastic-launch moves the stages' state between the running workers when the number of stages
changes (pp2dp2 on 2 nodes, pp1dp2 on one).

    elastic-launch --backend local --nnodes 1:2 --gpus-per-node 2 --layouts pp2dp2,pp1dp2 -- \\
        python examples/pipeline_live.py --steps 40 --log /tmp/pipe.log

    (with TP inside each stage: --gpus-per-node 4 --layouts pp2tp2dp2,pp1tp2dp2)

The stage is built the torchtitan way: the whole model with the same seed on every rank, then the
other stages' blocks replaced by nn.Identity and the input/head set to None where the stage does not
own them, so every tensor keeps its global name (`blocks.3.up.weight`) whatever the split: the
runtime's manifests of different splits match and a migration moves only the blocks that change
owner. Everything elastic is marked `# elastic`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from launcher import runtime  # elastic

IN, DIM, HIDDEN, BLOCKS = 6, 16, 32, 4


class Block(nn.Module):
    """x + down(relu(up(norm(x)))): up is column-, down row-parallel under TP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    """The whole model; `stage(layout)` cuts it to one pipeline stage under the same names."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial model on every rank
        self.embed = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def stage(layout) -> Stack:
    """This rank's pipeline stage (also called on the meta device for layouts no process holds)."""
    model = Stack()
    runtime.keep_stage_blocks(model.blocks, layout)  # elastic: other stages' blocks -> nn.Identity
    if not layout.is_first_stage:
        model.embed = None
    if not layout.is_last_stage:
        model.head = None
    return model


TP_PLAN = {**{f"blocks.{i}.up": ColwiseParallel() for i in range(BLOCKS)},
           **{f"blocks.{i}.down": RowwiseParallel() for i in range(BLOCKS)}}


class DataPosition:
    """How many samples the job has consumed: carried through every migration."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, d: dict) -> None:
        self.samples = d["samples"]


def batch(step: int, global_batch: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's share of step `step`'s global batch (the same global batch on every layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, IN, generator=g)
    y = x.sum(dim=1, keepdim=True).cos()
    per = global_batch // dp
    return x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]


def full_state(job) -> dict[str, torch.Tensor] | None:
    """Every tensor of the training state, whole, on global rank 0 (None elsewhere). A collective:
    TP shards are gathered within each stage, the stages' pieces on rank 0."""
    names = {id(p): n for n, p in job.model.named_parameters()}
    items = list(job.model.state_dict().items())
    for p, st in job.optimizer.state.items():
        items += [(f"optim.state.{names[id(p)]}.{k}", v) for k, v in sorted(st.items())]
    mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in items}
    lay = job.layout
    pieces = [None] * lay.world_size if lay.rank == 0 else None
    dist.gather_object(mine if lay.data_rank == 0 and lay.tp_rank == 0 else {}, pieces, dst=0)
    if lay.rank != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for piece in pieces:
        out.update(piece)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--log", type=Path, default=None, help="rank 0 appends `step loss layout samples` here")
    p.add_argument("--dump-dir", type=Path, default=None,
                   help="rank 0 saves the whole state after every step (tests)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="sleep this long after each step (tests, demos)")
    p.add_argument("--sleep-while", type=Path, default=None,
                   help="sleep after a step only while this file exists (a test removes it once it has resized "
                        "the job, and the last steps run at full speed)")
    args = p.parse_args()
    data = DataPosition()
    job = runtime.join(model=stage, tp_plan=TP_PLAN,  # elastic
                       optimizer=lambda params: torch.optim.Adam(params, lr=1e-2), state={"data": data})
    pipe = runtime.Pipeline(job, args.microbatches, nn.functional.mse_loss)  # elastic
    while job.next_step(until=args.steps):  # elastic: migrations happen here, between steps
        with job.guard():  # elastic: a step another worker's death broke is abandoned, the job recovers
            train_step(job, pipe, data, args)
        if args.step_sleep and (args.sleep_while is None or args.sleep_while.exists()):
            import time

            time.sleep(args.step_sleep)


def train_step(job, pipe, data: DataPosition, args) -> None:
    lay = job.layout
    x, y = batch(job.step, args.global_batch, lay.data_rank, lay.data_size)  # elastic: DP (x FSDP) share
    job.optimizer.zero_grad()
    loss = pipe.step(x, y)  # elastic: x feeds the first stage, y the loss on the last
    job.reduce_gradients()  # elastic: DP gradient mean
    job.optimizer.step()  # applied by every rank or by none
    data.samples += args.global_batch
    state = full_state(job) if args.dump_dir else None
    if state is not None:
        torch.save(state, args.dump_dir / f"after-{job.step}.pt")
    if lay.rank == 0:
        job.report_loss(loss)  # elastic: the job's loss timeline (elastic history, dashboard)
    if lay.rank == 0 and args.log:
        with open(args.log, "a") as f:
            f.write(f"{job.step} {loss.item()!r} {lay.name} {data.samples}\n")


if __name__ == "__main__":
    main()
