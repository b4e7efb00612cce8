"""`python -m launcher.worker`: one training worker (one device) of an elastic job running the
reference GPT (migrate.gpt) -- the demo model -- through the public runtime API, like any user's script.

elastic-launch starts one of these per device (through `srun` on Slurm, as local processes with the
local backend). It joins with `launcher.runtime.join`, giving the reference GPT's stage builder and
state manifest (migrate.gpt_live: the model shards itself Megatron-style) and its model flags (every
worker of a job must give the same), then trains with `job.next_step()` / `job.guard()` and the
reference trainer's step (migrate.gpt_live.train_step: its GPipe schedule over the layout's stages, TP
inside them, the DP gradient sum), so every layout computes what one process computes. Everything
elastic -- migrations at an agreed step boundary, recoveries from DP replicas, safety checkpoints,
suspend and resume, $ELASTIC_FAULT injection, torchrun's variables -- is the runtime's (launcher.runtime),
the one path every live-mode program takes.

The rank that reports the loss (first DP and TP rank of the last stage) puts it on the job's timeline,
prints it every --log-every steps and appends `step loss layout` to --loss-file.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from launcher.runtime.env import device_from_env
from launcher.wire.env import ENV_DEVICE, ENV_FIRST_DEVICE, ENV_STORE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launcher.worker",
        description="Elastic training worker running the reference GPT trainer (migrate.train) through the runtime "
                    "API (launcher.runtime). Started by "
                    "elastic-launch, one per device; it reads the control-plane address and its device from "
                    f"${ENV_STORE} and ${ENV_DEVICE} (or ${ENV_FIRST_DEVICE} + SLURM_LOCALID on Slurm).",
        epilog="Example: elastic-launch --nnodes 2:4 --gpus-per-node 4 --layouts pp4tp2,pp2tp2 --db sqlite:///e.db "
               "-- python -m launcher.worker --layers 24 --hidden 512",
    )
    m = p.add_argument_group("model (every worker of a job must give the same)")
    m.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    m.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    m.add_argument("--heads", type=int, default=0, help="attention heads (default hidden/64)")
    m.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    m.add_argument("--seq-len", type=int, default=32, help="sequence length (default 32)")
    t = p.add_argument_group("training")
    t.add_argument("--global-batch", type=int, default=8, help="sequences per step, fixed across layouts (default 8)")
    t.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    t.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    t.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data (default 0)")
    t.add_argument("--steps", type=int, default=0, help="stop after this many steps (default 0: until the launcher stops the job)")
    t.add_argument("--step-sleep", type=float, default=0.0, help="sleep this long after each step (demos and tests)")
    t.add_argument("--collective-timeout", type=float, default=120.0,
                   help="seconds a collective may wait for a peer before failing (default 120)")
    t.add_argument("--loss-file", default=None, metavar="PATH",
                   help="append `step loss layout` for every committed step to PATH (the rank that reports the "
                        "loss writes it; for tests and loss-curve comparisons)")
    t.add_argument("--log-every", type=int, default=1, help="print the loss every N steps (default 1; 0: never)")
    return p


def _model_and_config(args: argparse.Namespace):
    from migrate.layout import ModelSpec
    from migrate.train import TrainConfig

    model = ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)
    tc = TrainConfig(global_batch=args.global_batch, micro_batch=args.micro_batch, seq_len=args.seq_len, lr=args.lr,
                     seed=args.seed)
    return model, tc


def train(args: argparse.Namespace) -> int:
    """Join the job through the runtime and train until the launcher (or --steps) ends it."""
    import torch

    import migrate.train
    from launcher import runtime
    from migrate.gpt_live import build_stage, stage_manifest, train_step
    from migrate.layout import ParallelConfig

    model, tc = _model_and_config(args)
    torch.set_num_threads(1)
    migrate.train.warm_up()  # a standby worker must not pay first-use costs inside a migration
    job = runtime.join(model=lambda lay: build_stage(model, lay, tc.seed),
                       optimizer=lambda params: torch.optim.Adam(params, lr=tc.lr, fused=True),
                       manifest=lambda lay: stage_manifest(model, ParallelConfig.parse(lay.name), lay.rank),
                       model_info=model.flags(), collective_timeout=args.collective_timeout)
    while job.next_step(until=args.steps or None):
        with job.guard():
            loss = train_step(job, model, tc)  # the reference trainer's step; commits on every rank or none
            lay = job.layout
            if loss is not None and lay.dp_rank == 0 and lay.tp_rank == 0:  # one rank of the last stage
                job.report_loss(loss)
                if args.loss_file:
                    with open(args.loss_file, "a") as f:
                        f.write(f"{job.step} {loss!r} {lay.name}\n")
                if args.log_every and job.step % args.log_every == 0:
                    print(f"[worker dev{job.device}] step {job.step} loss {loss:.6f} on {lay.name}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        device_from_env()
        if ENV_STORE not in os.environ:
            raise RuntimeError(f"${ENV_STORE} is unset: start workers with elastic-launch")
        _model_and_config(args)
    except Exception as exc:  # bad flags or no launcher: one line
        print(f"launcher.worker: error: {exc}", file=sys.stderr)
        return 2
    try:
        rc = train(args)
    except SystemExit as exc:  # runtime.join refused this worker (its model differs): it said why
        rc = exc.code if isinstance(exc.code, int) else 2
    except Exception:
        traceback.print_exc()
        rc = 1
    # Skip the interpreter's teardown: DCP leaves gloo threads that can SIGABRT it (facts.md), and a
    # departing worker's teardown takes CPU from the new layout's first steps (2 cores, many workers).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
