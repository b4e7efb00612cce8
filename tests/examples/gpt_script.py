"""The reference GPT (migrate.gpt_live) trained through the public runtime API: the shape
`python -m launcher.worker` takes once it is rewritten on the API (issue 9). The model shards itself
(Megatron-style plain local shards), so it gives the runtime its manifest (`manifest=`) instead of a
tp_plan. The step is the reference trainer's (migrate.gpt_live.train_step: its pipeline schedule over the
layout's stages, TP inside them, DP gradient sum). The first rank of the last stage appends `step loss layout`
for every step to --loss-file; the data of step S is migrate.train.batch(S - 1), split over the DP ranks, so
every layout computes the one-process run."""
from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from launcher import runtime
from launcher.runtime.threads import DEFAULT_NICE, gloo_threads, thread_nice
from migrate.gpt_live import build_stage, stage_manifest, train_step
from migrate.layout import ModelSpec, ParallelConfig
from migrate.train import TrainConfig

MODEL = ModelSpec(layers=4, hidden=128, vocab=512, seq_len=32)  # tests/launcher/test_faults.MODEL


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--loss-file", required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--sleep-while", default=None, help="sleep after a step only while this file exists")
    p.add_argument("--gc-file", default=None, help="every rank appends `pid migrations step frozen-objects "
                                                   "lowered/all-gloo-io-threads` per step")
    args = p.parse_args()
    torch.set_num_threads(1)
    tc = TrainConfig()
    job = runtime.join(model=lambda lay: build_stage(MODEL, lay, tc.seed),
                       optimizer=lambda params: torch.optim.Adam(params, lr=tc.lr, fused=True),
                       manifest=lambda lay: stage_manifest(MODEL, ParallelConfig.parse(lay.name), lay.rank))
    while job.next_step(until=args.steps):
        if args.gc_file:  # what the garbage collector may walk during this step (launcher.runtime.collector)
            with open(args.gc_file, "a") as f:
                nices = []
                for t in gloo_threads():
                    try:
                        nices.append(thread_nice(t))
                    except ProcessLookupError:  # ended since the listing (a destroyed group's thread)
                        continue
                low, every = sum(n >= DEFAULT_NICE for n in nices), len(nices)
                f.write(f"{os.getpid()} {job.migrations} {job.step} {gc.get_freeze_count()} {low}/{every}\n")
        with job.guard():
            loss = train_step(job, MODEL, tc)  # the reference trainer's step (PP schedule, TP, DP sum)
            lay = job.layout
            if loss is not None and lay.dp_rank == 0 and lay.tp_rank == 0:  # one rank of the last stage
                job.report_loss(loss)  # the job's timeline in the database
                with open(args.loss_file, "a") as f:
                    f.write(f"{job.step} {loss!r} {lay.name}\n")
        if args.sleep_while is None or os.path.exists(args.sleep_while):
            time.sleep(args.step_sleep)


if __name__ == "__main__":
    main()
