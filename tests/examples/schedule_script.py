"""A live-mode script whose learning rate follows a schedule (torch.optim.lr_scheduler: a warm-up then an
exponential decay, SequentialLR) declared to `runtime.join(scheduler=...)`; the tests resize its job and
compare every step's lr and loss with an uninterrupted run (tests/examples/test_schedule_live.py). With
--optimizer another torch.optim class trains it, --clip clips the gradients by `job.clip_grad_norm_` and
--dump-dir saves the whole state around every step (tests/examples/test_optimizers_live.py). With --undeclared
it makes its scheduler on job.optimizer itself, as the guide says not to: a worker that joins at a grow starts
that schedule from the beginning, and the runtime stops the job instead of letting the replicas diverge.

Before the runtime carried the optimizer's settings, `join` took no scheduler and `job.optimizer` was a new
object after every migration: the script then did what a script could, make its scheduler on the first
optimizer it saw (--old-api), and the lr went back to the factory's value at the first migration."""
from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.optim.lr_scheduler import ExponentialLR, LinearLR, SequentialLR

from launcher import runtime

LR = 1e-2
#: settings besides lr, where the defaults keep less state than the optimizer can
SETTINGS = {"SGD": {"momentum": 0.9}, "RMSprop": {"momentum": 0.9, "centered": True}}


def model(_layout) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def schedule(opt) -> SequentialLR:
    return SequentialLR(opt, [LinearLR(opt, start_factor=0.1, total_iters=3), ExponentialLR(opt, gamma=0.8)],
                        milestones=[3])


def batch(step: int, dp_rank: int, dp: int, global_batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(global_batch, 16, generator=g)
    per = global_batch // dp
    return x[dp_rank * per:(dp_rank + 1) * per], x.sum(dim=1, keepdim=True).sin()[dp_rank * per:(dp_rank + 1) * per]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log", type=Path, required=True, help="rank 0 appends `step loss layout samples`")
    p.add_argument("--lr-log", type=Path, required=True, help="rank 0 appends `step lr-before-the-step`")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--sleep-while", type=Path, default=None)
    p.add_argument("--optimizer", default="Adam", help="a torch.optim class name")
    p.add_argument("--clip", type=float, default=None, help="job.clip_grad_norm_ to this norm; rank 0 logs it")
    p.add_argument("--dump-dir", type=Path, default=None, help="rank 0 saves the whole state before and after steps")
    p.add_argument("--undeclared", action="store_true", help="make the scheduler on job.optimizer, not in join")
    args = p.parse_args()
    cls = getattr(torch.optim, args.optimizer)
    kwargs = dict(model=model, tp_plan={"0": ColwiseParallel(), "2": RowwiseParallel()},
                  optimizer=lambda params: cls(params, lr=LR, **SETTINGS.get(args.optimizer, {})))
    declared = "scheduler" in inspect.signature(runtime.join).parameters
    if declared and not args.undeclared:
        kwargs["scheduler"] = schedule
    job = runtime.join(**kwargs)
    sched = schedule(job.optimizer) if args.undeclared else job.scheduler if declared else None
    while job.next_step(until=args.steps):
        with job.guard():
            if sched is None:  # the old API: the first optimizer this worker sees
                sched = schedule(job.optimizer)
            lay = job.layout
            dump(job, args.dump_dir, f"before-{job.step}.pt")
            lr = job.optimizer.param_groups[0]["lr"]
            x, y = batch(job.step, lay.dp_rank, lay.dp)
            loss = nn.functional.mse_loss(job.model(x), y)
            job.optimizer.zero_grad()
            loss.backward()
            job.reduce_gradients()
            norm = job.clip_grad_norm_(args.clip) if args.clip is not None else None
            job.optimizer.step()
            sched.step()
            dump(job, args.dump_dir, f"after-{job.step}.pt")
            seen = loss.detach().clone()  # the global batch's loss (the mean of the DP ranks' equal shares)
            if lay.dp > 1:
                torch.distributed.all_reduce(seen, group=lay.dp_group)
                seen /= lay.dp
            if lay.rank == 0:
                with open(args.lr_log, "a") as f:
                    f.write(f"{job.step} {lr!r}" + (f" {float(norm)!r}" if norm is not None else "") + "\n")
                with open(args.log, "a") as f:
                    f.write(f"{job.step} {seen.item()!r} {lay.name} {8 * job.step}\n")
        if args.step_sleep and (args.sleep_while is None or args.sleep_while.exists()):
            import time

            time.sleep(args.step_sleep)


def dump(job, folder: Path | None, name: str) -> None:
    """The whole state (every tensor, full: examples/mixer_live.py's full_state), saved by rank 0."""
    if folder is None:
        return
    state = _full_state()(job)  # a collective: every rank gathers
    if job.layout.rank == 0:
        torch.save(state, folder / name)


@functools.cache
def _full_state():
    spec = importlib.util.spec_from_file_location("mixer_live", Path(__file__).parents[2] / "examples" / "mixer_live.py")
    mixer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mixer)
    return mixer.full_state


if __name__ == "__main__":
    main()
