"""The reference model: one pipeline stage of a small GPT, Megatron-style tensor parallel.

Its parameter names are exactly `ModelSpec.tensors()` names and their local shapes follow the
same layout rules the planner uses, so the executor can hand received tensors straight to it.
TP uses the two Megatron region functions (copy-to / reduce-from the TP group) plus a gather
of vocabulary-parallel logits; with tp == 1 they are identities.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from migrate.layout import ModelSpec, TensorSpec
from migrate.state import local_shape
from migrate.workload import Workload


def tp_all_reduce(x: torch.Tensor, group, members: list[int] | None) -> torch.Tensor:
    """Sum `x` over the TP group; on gloo (`members` given, the group ranks in TP order) by exchanging
    whole tensors between members; elsewhere (NCCL, `members` None) with the backend's own all-reduce.

    TP all-reduces are small (one activation) and many (four per layer and micro-batch), so their
    cost is per message, not per byte: gloo's ring sends 2(n-1) messages per member in as many
    dependent hops, each waiting for the next process to be scheduled on a node with more processes
    than cores. A power-of-two group exchanges in log2(n) rounds of one message each way (recursive
    doubling: in round k a member swaps its partial sum with the member whose TP index differs in bit
    k); another size in one round where every member sends to every other. Every member ends with
    the same bits, as replicated parameters need: in recursive doubling each round adds two partial
    sums that both partners hold (a + b and b + a are the same float), in the one round every member
    adds the parts in TP order.
    """
    x = x.contiguous()
    if members is None:
        dist.all_reduce(x, group=group)
        return x
    me = dist.get_rank(group)
    if len(members) & (len(members) - 1) == 0:
        return _doubling_sum(x, group, members, members.index(me))
    return _one_round_sum(x, group, members, me)


def _doubling_sum(x: torch.Tensor, group, members: list[int], pos: int) -> torch.Tensor:
    """Recursive doubling over a power-of-two group; `pos` is this member's TP index."""
    total, bit = x, 1
    while bit < len(members):
        peer = members[pos ^ bit]
        part = torch.empty_like(x)
        recv = dist.irecv(part, group=group, group_src=peer)
        dist.isend(total, group=group, group_dst=peer).wait()
        recv.wait()
        total, bit = total + part, bit << 1
    return total


def _one_round_sum(x: torch.Tensor, group, members: list[int], me: int) -> torch.Tensor:
    """Every member sends `x` to every other and adds all parts in TP order."""
    parts, pending = [], []
    for peer in members:
        if peer == me:
            parts.append(x)
            continue
        part = torch.empty_like(x)
        parts.append(part)
        pending.append(dist.irecv(part, group=group, group_src=peer))
        pending.append(dist.isend(x, group=group, group_dst=peer))
    for work in pending:
        work.wait()
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, members):
        ctx.group, ctx.members = group, members
        return x

    @staticmethod
    def backward(ctx, grad):
        return tp_all_reduce(grad, ctx.group, ctx.members), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, members):
        return tp_all_reduce(x, group, members)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim in TP order (a group numbers its members by sorted world rank)."""

    @staticmethod
    def forward(ctx, x, group, slot_of_tp, my_tp):
        ctx.size, ctx.my_tp = len(slot_of_tp), my_tp
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat([parts[slot] for slot in slot_of_tp], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=-1)[ctx.my_tp].contiguous(), None, None, None


class TPGroup:
    """The TP process group of this rank (None when tp == 1) and its members' world ranks in TP order."""

    def __init__(self, group, world_ranks: list[int] | None = None, my_tp: int = 0) -> None:
        self.group, self.my_tp = group, my_tp
        ranks = world_ranks or []
        self.slot_of_tp = [sorted(ranks).index(r) for r in ranks]
        gloo = group is not None and dist.get_backend(group) == "gloo"
        self.direct_members = self.slot_of_tp if gloo else None  # tp_all_reduce: member to member on gloo

    def copy(self, x):
        return x if self.group is None else _CopyToTP.apply(x, self.group, self.direct_members)

    def reduce(self, x):
        return x if self.group is None else _ReduceFromTP.apply(x, self.group, self.direct_members)

    def gather(self, x):
        return x if self.group is None else _GatherFromTP.apply(x, self.group, self.slot_of_tp, self.my_tp)


class _Holder(nn.Module):
    """A module that only holds named parameters (names may be nested with dots)."""


def _build(module: nn.Module, tensors: list[TensorSpec], w: Workload, prefix: str) -> None:
    """Register each tensor's local shard as a parameter under its layout-rule name."""
    for t in tensors:
        path = t.name[len(prefix):].split(".")
        node = module
        for part in path[:-1]:
            if not hasattr(node, part):
                node.add_module(part, _Holder())
            node = getattr(node, part)
        node.register_parameter(path[-1], nn.Parameter(torch.empty(local_shape(t, w))))


class GPTStage(nn.Module):
    """Layers [w.layer_lo, w.layer_hi) of the model, plus the embedding / head on the ends."""

    def __init__(self, model: ModelSpec, w: Workload, tp: TPGroup) -> None:
        super().__init__()
        self.model, self.w, self.tp = model, w, tp
        self.heads_local = model.heads * (w.slice_hi - w.slice_lo) // w.of
        self.vocab_lo = model.vocab * w.slice_lo // w.of
        self.vocab_local = model.vocab * (w.slice_hi - w.slice_lo) // w.of
        self.layers = nn.ModuleDict()
        for layer in range(w.layer_lo, w.layer_hi):
            block = _Holder()
            _build(block, model.layer_tensors(layer), w, f"layers.{layer}.")
            self.layers[str(layer)] = block
        if w.first:
            self.embed = _Holder()
            _build(self.embed, model.embed_tensors(), w, "embed.")
        if w.last:
            self.head = _Holder()
            _build(self.head, model.head_tensors(), w, "head.")

    def load(self, params: dict[str, torch.Tensor]) -> None:
        """Adopt the given tensors as parameters, without copying them."""
        for name, _ in list(self.named_parameters()):
            owner_name, leaf = name.rsplit(".", 1)
            self.get_submodule(owner_name).register_parameter(leaf, nn.Parameter(params[name]))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        wte = self.embed.wte.weight
        local = ids - self.vocab_lo
        mask = (local < 0) | (local >= self.vocab_local)
        x = F.embedding(local.masked_fill(mask, 0), wte).masked_fill(mask.unsqueeze(-1), 0.0)
        return self.tp.reduce(x) + self.embed.wpe.weight[: ids.shape[1]]

    def block(self, b: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = self.model.hidden
        hd = h // self.model.heads
        y = self.tp.copy(F.layer_norm(x, (h,), b.ln1.weight, b.ln1.bias))
        qkv = F.linear(y, b.attn.qkv.weight, b.attn.qkv.bias)
        bsz, seq = x.shape[:2]
        q, k, v = qkv.view(bsz, seq, self.heads_local, 3, hd).permute(3, 0, 2, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bsz, seq, -1)
        x = x + self.tp.reduce(F.linear(a, b.attn.proj.weight)) + b.attn.proj.bias
        y = self.tp.copy(F.layer_norm(x, (h,), b.ln2.weight, b.ln2.bias))
        y = F.gelu(F.linear(y, b.mlp.fc1.weight, b.mlp.fc1.bias))
        return x + self.tp.reduce(F.linear(y, b.mlp.fc2.weight)) + b.mlp.fc2.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids on the first stage, activations elsewhere; logits (full vocab) on the last."""
        if self.w.first:
            x = self.embed_tokens(x)
        for layer in range(self.w.layer_lo, self.w.layer_hi):
            x = self.block(self.layers[str(layer)], x)
        if self.w.last:
            x = F.layer_norm(x, (self.model.hidden,), self.head.ln_f.weight, self.head.ln_f.bias)
            x = self.tp.gather(F.linear(self.tp.copy(x), self.head.lm_head.weight))
        return x
