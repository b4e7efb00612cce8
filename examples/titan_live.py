"""A torchtitan-shaped training script in LIVE mode: a small Llama-style decoder (token embedding, transformer
blocks of RMSNorm, causal attention and a SwiGLU feed-forward, output head) with torchtitan's tensor-parallel
plan, FSDP2 or plain data parallel, AdamW with weight-decay groups, a warm-up + cosine learning-rate schedule
and gradient clipping. elastic-launch shrinks and grows it between steps; the schedule, the optimizer's
settings and the data position go on as if nothing happened.

    elastic-launch --backend local --nnodes 1:2 --gpus-per-node 2 --layouts tp2fsdp2,tp2dp1 -- \\
        python examples/titan_live.py --steps 60 --log /tmp/titan.log

`tp2fsdp2` is torchtitan's FSDP2 x TP: the runtime applies the TP plan, then `fully_shard` over the fsdp
dimension, so each of the 4 ranks holds a quarter of every parameter and of its AdamW moments; `tp2dp2`
would replicate them over DP instead, `tp2hsdp2x2` (8 ranks) shard over 2 and replicate twice.
Everything elastic is in the lines marked `# elastic`; the rest is an ordinary training loop.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.nn import functional as F
from torch.optim.lr_scheduler import LambdaLR

from launcher import runtime  # elastic

VOCAB, DIM, HEADS, LAYERS, SEQ = 128, 64, 4, 2, 16
HEAD_DIM, FFN = DIM // HEADS, 4 * DIM
LR, WEIGHT_DECAY, WARMUP, MAX_NORM = 3e-3, 0.1, 5, 1.0


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the heads this rank holds (all of them, or HEADS / tp under tensor parallelism)
        q, k, v = (w(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial model on every rank
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tp_plan() -> dict:
    """torchtitan's plan for the blocks: q, k, v and the SwiGLU's w1, w3 column-parallel, wo and w2 row-parallel."""
    plan = {}
    for i in range(LAYERS):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


def adamw(params) -> torch.optim.AdamW:
    """nanoGPT's rule: matrices decay, vectors (norms) do not. Two groups on every layout, as live mode needs."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95))


def warmup_cosine(steps: int):
    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / max(1, steps - WARMUP))))
    return lambda opt: LambdaLR(opt, factor)


class DataPosition:
    """Where the token stream stands: carried through every migration."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, d: dict) -> None:
        self.samples = d["samples"]


def batch(step: int, global_batch: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data rank's share (of `dp`: DP replicas times FSDP shards) of step `step`'s global batch: sequences that follow t -> 5t + 3 (mod VOCAB) from
    a random start (something to learn), the same global batch on every layout."""
    g = torch.Generator().manual_seed(step)
    seq = [torch.randint(0, VOCAB, (global_batch,), generator=g)]
    for _ in range(SEQ):
        seq.append((5 * seq[-1] + 3) % VOCAB)
    per = global_batch // dp
    mine = torch.stack(seq, dim=1)[dp_rank * per:(dp_rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


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


def dump(job, path: Path | None, when: str) -> None:
    if path is not None:
        state = full_state(job)
        if job.layout.rank == 0:
            torch.save(state, path / f"{when}-{job.step}.pt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--log", type=Path, default=None, help="rank 0 appends `step loss layout samples` here")
    p.add_argument("--lr-log", type=Path, default=None, help="rank 0 appends `step lr grad-norm` here")
    p.add_argument("--dump-dir", type=Path, default=None,
                   help="rank 0 saves the whole state before and after every step (tests)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="sleep this long after each step (tests, demos)")
    p.add_argument("--sleep-while", type=Path, default=None,
                   help="sleep after a step only while this file exists (a test removes it once it has resized the job)")
    args = p.parse_args()
    data = DataPosition()
    job = runtime.join(model=lambda layout: Transformer(), tp_plan=tp_plan(), optimizer=adamw,  # elastic
                       scheduler=warmup_cosine(args.steps), state={"data": data},
                       fsdp_units=lambda model: model.layers)  # elastic: FSDP2 gathers a block at a time
    while job.next_step(until=args.steps):  # elastic: migrations happen here, between steps
        with job.guard():  # elastic: a step another worker's death broke is abandoned, the job recovers
            dump(job, args.dump_dir, "before")
            train_step(job, data, args)
            dump(job, args.dump_dir, "after")
        if args.step_sleep and (args.sleep_while is None or args.sleep_while.exists()):
            import time

            time.sleep(args.step_sleep)


def train_step(job, data: DataPosition, args) -> None:
    lay = job.layout
    tokens, targets = batch(job.step, args.global_batch, lay.data_rank, lay.data_size)  # elastic: DP x FSDP
    lr = job.optimizer.param_groups[0]["lr"]
    loss = F.cross_entropy(job.model(tokens).flatten(0, 1), targets.flatten())
    job.optimizer.zero_grad()
    loss.backward()
    job.reduce_gradients()  # elastic: DP gradient mean (FSDP2 made it in backward on an fsdp layout)
    norm = job.clip_grad_norm_(MAX_NORM)  # elastic: the norm of the whole model's gradient, over TP, FSDP and DP
    job.optimizer.step()  # applied by every rank or by none
    job.scheduler.step()
    data.samples += args.global_batch
    seen = loss.detach().clone()  # the global batch's loss: the mean of the data ranks' equal shares
    if lay.data_size > 1:  # (every TP rank has its data rank's loss: the mean over all ranks is the same)
        torch.distributed.all_reduce(seen)
        seen /= lay.world_size
    if lay.rank == 0:
        job.report_loss(seen)  # elastic: the job's loss timeline (elastic history, dashboard)
        if args.log:
            with open(args.log, "a") as f:
                f.write(f"{job.step} {seen.item()!r} {lay.name} {data.samples}\n")
        if args.lr_log:
            with open(args.lr_log, "a") as f:
                f.write(f"{job.step} {lr!r} {float(norm)!r}\n")


if __name__ == "__main__":
    main()
