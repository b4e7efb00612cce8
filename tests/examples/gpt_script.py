"""The reference GPT (migrate.gpt_live) trained through the public runtime API: the shape
`python -m launcher.worker` takes once it is rewritten on the API (issue 9). The model shards itself
(Megatron-style plain local shards), so it gives the runtime its manifest (`manifest=`) instead of a
tp_plan. Rank 0 appends `step loss layout` for every step to --loss-file; the data of step S is
migrate.train.batch(S - 1), split over the DP ranks, so every layout computes the one-process run."""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from launcher import runtime
from migrate.gpt_live import build_stage, stage_manifest
from migrate.layout import ModelSpec, ParallelConfig
from migrate.train import TrainConfig, batch

MODEL = ModelSpec(layers=4, hidden=128, vocab=512, seq_len=32)  # tests/launcher/test_faults.MODEL


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--loss-file", required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    tc = TrainConfig()
    job = runtime.join(model=lambda lay: build_stage(MODEL, lay, tc.seed),
                       optimizer=lambda params: torch.optim.Adam(params, lr=tc.lr, foreach=False),
                       manifest=lambda lay: stage_manifest(MODEL, ParallelConfig.parse(lay.name), lay.rank))
    while job.next_step(until=args.steps):
        with job.guard():
            lay = job.layout
            per = tc.global_batch // lay.dp
            mine = batch(MODEL, tc, job.step - 1)[lay.dp_rank * per:(lay.dp_rank + 1) * per]
            job.optimizer.zero_grad()
            losses = [F.cross_entropy(job.model(mb[:, :-1]).reshape(-1, MODEL.vocab), mb[:, 1:].reshape(-1),
                                      reduction="sum") / (tc.global_batch * tc.seq_len)
                      for mb in mine.split(tc.micro_batch)]
            for loss in reversed(losses):  # the reference trainer's order
                (loss * lay.dp).backward()  # reduce_gradients averages: the global loss wants the DP sum
            job.reduce_gradients()
            job.optimizer.step()
            total = torch.zeros(())
            for loss in losses:
                total = total + loss.detach()
            if lay.dp > 1:
                dist.all_reduce(total, group=lay.dp_group)
            if lay.rank == 0:
                job.report_loss(total)  # the job's timeline in the database
                with open(args.loss_file, "a") as f:
                    f.write(f"{job.step} {float(total)!r} {lay.name}\n")
        time.sleep(args.step_sleep)


if __name__ == "__main__":
    main()
