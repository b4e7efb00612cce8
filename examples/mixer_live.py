"""An MLP-Mixer in LIVE mode: tensor parallel through parallelize_module plus data parallel, its state
moved between the running workers when elastic-launch resizes the job (no step lost or repeated).

    elastic-launch --backend local --nnodes 1:2 --gpus-per-node 2 --layouts tp2dp2,tp2dp1 -- \\
        python examples/mixer_live.py --steps 40 --log /tmp/mixer.log

Everything elastic is in the lines marked `# elastic`; the rest is an ordinary training loop. `--plain` runs
the same training written with torch.distributed alone (`plain_main`, for `elastic-launch --mode restart` or
torchrun): the difference between the two is what live mode asks of a script.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from launcher import runtime  # elastic

TOKENS, DIM, HIDDEN = 8, 16, 32
TP_PLAN = {"block.channel_up": ColwiseParallel(), "block.channel_down": RowwiseParallel()}


class MixerBlock(nn.Module):
    """Token mixing (replicated) then channel mixing (the TP part: channel_up column-, channel_down row-parallel)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.token_mix = nn.Linear(TOKENS, TOKENS)
        self.channel_up = nn.Linear(DIM, HIDDEN)
        self.channel_down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_down(torch.relu(self.channel_up(self.norm2(x))))


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial model on every rank
        self.block = MixerBlock()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x)).mean(dim=(1, 2))


class DataPosition:
    """Where the data stream stands: carried through every migration."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, d: dict) -> None:
        self.samples = d["samples"]


def batch(step: int, global_batch: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's share of step `step`'s global batch (the same global batch on every layout)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(global_batch, TOKENS, DIM, generator=g)
    y = x.mean(dim=(1, 2)).sin()
    per = global_batch // dp
    return x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]


def full_state(job) -> dict[str, torch.Tensor]:
    """Every tensor of the training state, whole (a collective: every rank calls it)."""
    out = {}
    names = {id(p): n for n, p in job.model.named_parameters()}
    items = list(job.model.state_dict().items())
    for p, st in job.optimizer.state.items():
        items += [(f"optim.state.{names[id(p)]}.{k}", v) for k, v in sorted(st.items())]
    for k, v in items:
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--log", type=Path, default=None, help="rank 0 appends `step loss layout` here")
    p.add_argument("--dump-dir", type=Path, default=None,
                   help="rank 0 saves the whole state after every step and before every step (tests)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="sleep this long after each step (tests, demos)")
    p.add_argument("--sleep-while", type=Path, default=None,
                   help="sleep after a step only while this file exists (a test removes it once it has resized "
                        "the job, and the last steps run at full speed)")
    p.add_argument("--plain", action="store_true",
                   help="train without the runtime, as a torchrun script (tp 2, dp the rest; run it with "
                        "elastic-launch --mode restart): what `elastic bench-control --steady` times live mode against")
    args = p.parse_args()
    if args.plain:
        plain_main(args)
        return
    data = DataPosition()
    job = runtime.join(model=lambda layout: Mixer(),  # elastic
                       tp_plan=TP_PLAN,
                       optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
                       state={"data": data})
    while job.next_step(until=args.steps):  # elastic: migrations happen here, between steps
        with job.guard():  # elastic: a step another worker's death broke is abandoned, the job recovers
            train_step(job, data, args)
        if args.step_sleep and (args.sleep_while is None or args.sleep_while.exists()):
            import time

            time.sleep(args.step_sleep)


def train_step(job, data: DataPosition, args) -> None:
    lay = job.layout
    if args.dump_dir:
        state = full_state(job)
        if lay.rank == 0:
            torch.save(state, args.dump_dir / f"before-{job.step}.pt")
    x, y = batch(job.step, args.global_batch, lay.dp_rank, lay.dp)
    loss = nn.functional.mse_loss(job.model(x), y)
    job.optimizer.zero_grad()
    loss.backward()
    job.reduce_gradients()  # elastic: DP gradient mean
    job.optimizer.step()  # applied by every rank or by none
    data.samples += args.global_batch
    if args.dump_dir:
        state = full_state(job)
        if lay.rank == 0:
            torch.save(state, args.dump_dir / f"after-{job.step}.pt")
    if lay.rank == 0:
        job.report_loss(loss)  # elastic: the job's loss timeline (elastic history, dashboard)
    if lay.rank == 0 and args.log:
        with open(args.log, "a") as f:
            f.write(f"{job.step} {loss.item():.6f} {lay.name} {data.samples}\n")


def plain_main(args) -> None:
    """The same training with no runtime in the loop: torch.distributed alone, a (dp, tp) device mesh in the
    runtime's rank order (tp fastest), the same TP plan, batches, optimizer and DP gradient mean, on one
    thread (OMP_NUM_THREADS=1 from the launcher, as the runtime's workers). With
    $ELASTIC_RUNTIME_STATS set, every rank writes its steps' wall times there, as a live worker does."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from launcher.runtime.overhead import StepCost
    from launcher.runtime.threads import GlooThreads

    dist.init_process_group("gloo")
    rank, dp = dist.get_rank(), dist.get_world_size() // 2
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(Mixer(), mesh["tp"], TP_PLAN)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    dp_rank, dp_group = mesh.get_local_rank("dp"), mesh["dp"].get_group()
    # gloo's I/O threads at a low priority, as the runtime keeps them (a CPU-only tuning, not the runtime's
    # loop: without it this CPU-oversubscribed box gives these threads a third of its cores)
    GlooThreads().lower()
    cost = StepCost()  # each step's wall time, from the second on (no boundary, no vote: both 0)
    for step in range(1, args.steps + 1):
        x, y = batch(step, args.global_batch, dp_rank, dp)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        for prm in model.parameters():
            grad = prm.grad.to_local() if isinstance(prm.grad, DTensor) else prm.grad
            dist.all_reduce(grad, group=dp_group)
            grad.div_(dp)
        optimizer.step()
        now = time.perf_counter()
        cost.boundary(now, now, steady=True)
        if rank == 0 and args.log:
            with open(args.log, "a") as f:
                f.write(f"{step} {loss.item():.6f} plain-tp2dp{dp} {step * args.global_batch}\n")
    cost.write(rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
