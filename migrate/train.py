"""The reference trainer's step: GPipe over PP stages, TP inside the stage, DP gradient all-reduce.

The global batch and the micro-batch size are fixed for the whole run, so a layout with fewer
DP replicas accumulates more micro-batches and the mathematics of a step does not change.
Data is synthetic and a pure function of (seed, step): a run can be repeated exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from migrate.gpt import GPTStage, TPGroup
from migrate.layout import LayoutError, ModelSpec, ParallelConfig
from migrate.state import LocalState
from migrate.workload import rank_workload


@dataclass(frozen=True)
class TrainConfig:
    global_batch: int = 8
    micro_batch: int = 1
    seq_len: int = 32
    lr: float = 1e-3
    seed: int = 0


def batch(model: ModelSpec, tc: TrainConfig, step: int) -> torch.Tensor:
    """Token ids [global_batch, seq_len + 1] for a step: noisy arithmetic sequences a model can learn."""
    g = torch.Generator().manual_seed(tc.seed * 7919 + step)
    start = torch.randint(0, model.vocab, (tc.global_batch, 1), generator=g)
    stride = torch.randint(1, 7, (tc.global_batch, 1), generator=g)
    ids = (start + stride * torch.arange(tc.seq_len + 1)) % model.vocab
    noise = torch.rand(ids.shape, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, model.vocab, ids.shape, generator=g), ids)


def warm_up() -> None:
    """What a joining worker does while it waits: pay the one-time lazy imports of building a model
    and an optimizer before a migration, not inside it."""
    p = torch.nn.Parameter(torch.zeros(1, 1, 2, 4))
    opt = torch.optim.Adam([p], fused=True)
    F.scaled_dot_product_attention(p, p, p, is_causal=True).sum().backward()
    opt.step()


class Groups:
    """This rank's TP and DP process groups (None when of size 1).

    Only the members create a group (local synchronisation), TP groups before DP groups, so
    processes outside the layout, or ones that died, are never waited for.
    """

    def __init__(self, cfg: ParallelConfig, world_rank: list[int], me: int | None) -> None:
        self.tp = self.dp = None
        self.tp_ranks: list[int] = []
        if me is None:
            return
        pp, dp, tp = cfg.coords(me)
        if cfg.tp > 1:
            self.tp_ranks = [world_rank[cfg.rank(pp, dp, t)] for t in range(cfg.tp)]
            self.tp = dist.new_group(self.tp_ranks, use_local_synchronization=True)
        if cfg.dp > 1:
            self.dp = dist.new_group([world_rank[cfg.rank(pp, d, tp)] for d in range(cfg.dp)],
                                     use_local_synchronization=True)


class Trainer:
    """One rank of the layout: its stage module, its Adam, and the step loop."""

    def __init__(self, model: ModelSpec, cfg: ParallelConfig, rank: int, state: LocalState,
                 world_rank: list[int], groups: Groups, tc: TrainConfig) -> None:
        if tc.global_batch % (cfg.dp * tc.micro_batch):
            raise LayoutError(f"{cfg}: global batch {tc.global_batch} does not split into dp={cfg.dp} replicas "
                              f"of micro-batches of {tc.micro_batch}; pick a global batch divisible by "
                              f"{cfg.dp * tc.micro_batch}")
        self.model, self.cfg, self.rank, self.tc = model, cfg, rank, tc
        self.world_rank, self.groups = world_rank, groups
        self.pp, self.dp, self.tp = cfg.coords(rank)
        self.w = rank_workload(cfg, rank, model.layers, cfg.tp)
        self.stage = GPTStage(model, self.w, TPGroup(groups.tp, groups.tp_ranks, self.tp))
        self.stage.load(state.tensors["param"])
        self.step_no = state.step
        params = dict(self.stage.named_parameters())
        self.opt = torch.optim.Adam(params.values(), lr=tc.lr, fused=True)
        if "exp_avg" in state.tensors and state.step > 0:
            for name, p in params.items():
                self.opt.state[p] = {"step": torch.tensor(float(state.step)),
                                     "exp_avg": state.tensors["exp_avg"][name],
                                     "exp_avg_sq": state.tensors["exp_avg_sq"][name]}
        self._zero_moments = state.tensors if state.step == 0 else None
        if "rng" in state.meta:
            torch.set_rng_state(state.meta["rng"])

    def export_state(self) -> LocalState:
        """The state as the planner sees it: params and Adam moments by tensor name (no copies)."""
        tensors: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for name, p in self.stage.named_parameters():
            tensors["param"][name] = p.data
            st = self.opt.state.get(p)
            if st:
                tensors["exp_avg"][name], tensors["exp_avg_sq"][name] = st["exp_avg"], st["exp_avg_sq"]
            else:
                tensors["exp_avg"][name] = self._zero_moments["exp_avg"][name]
                tensors["exp_avg_sq"][name] = self._zero_moments["exp_avg_sq"][name]
        return LocalState(tensors, self.step_no, {"rng": torch.get_rng_state(), "seed": self.tc.seed,
                                                  "data_step": self.step_no})

    def _peer(self, pp: int) -> int:
        return self.world_rank[self.cfg.rank(pp, self.dp, self.tp)]

    def train_step(self) -> float | None:
        """One optimizer step over the global batch; the global mean loss on last-stage ranks, else None."""
        first, last = self.w.first, self.w.last
        loss_sum = stage_step(self.stage, self.model, self.tc, self.step_no, self.dp, self.cfg.dp,
                              None if first else self._peer(self.pp - 1), None if last else self._peer(self.pp + 1),
                              self.groups.dp)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1
        return float(loss_sum) if last else None


def stage_step(stage: GPTStage, model: ModelSpec, tc: TrainConfig, step: int, dp_rank: int, dp: int,
               prev: int | None, next_: int | None, dp_group) -> torch.Tensor:
    """Forward and backward of this rank's part of step `step` (0-based: the data of `batch(step)`): GPipe over
    the stages (activations from process-group rank `prev`, to `next_`; None on the first / last stage),
    every micro-batch forward, then backward in reverse. Leaves the gradients in the stage's parameters,
    summed over the DP replicas (`dp_group`, None when dp == 1): with the loss divided by all the step's
    tokens that is the gradient of the global mean loss. Returns that loss on last-stage ranks (zeros
    elsewhere). The reference worker's step on any layout, whoever holds the optimizer."""
    first, last = prev is None, next_ is None
    data = batch(model, tc, step)
    per_replica = tc.global_batch // dp
    mine = data[dp_rank * per_replica:(dp_rank + 1) * per_replica]
    tokens_total = tc.global_batch * tc.seq_len
    act_shape = (tc.micro_batch, tc.seq_len, model.hidden)
    saved, loss_sum = [], torch.zeros(())
    for mb in mine.split(tc.micro_batch):
        if first:
            inp = mb[:, :-1]
        else:
            inp = torch.empty(act_shape)
            dist.recv(inp, src=prev)
            inp.requires_grad_(True)
        out = stage(inp)
        if last:
            loss = F.cross_entropy(out.reshape(-1, model.vocab), mb[:, 1:].reshape(-1),
                                   reduction="sum") / tokens_total
            loss_sum = loss_sum + loss.detach()
            out = loss
        else:
            dist.send(out.detach().contiguous(), dst=next_)
        saved.append((inp, out))
    for inp, out in reversed(saved):
        if last:
            out.backward()
        else:
            grad = torch.empty(act_shape)
            dist.recv(grad, src=next_)
            out.backward(grad)
        if not first:
            dist.send(inp.grad.contiguous(), dst=prev)
    if dp_group is not None:
        for p in stage.parameters():
            dist.all_reduce(p.grad, group=dp_group)
        dist.all_reduce(loss_sum, group=dp_group)
    return loss_sum
