"""Parallel layouts and the model whose state they split.

Everything the planner needs to know about *where* state lives comes from these two
frozen records and the layout rules in `ModelSpec.tensors()`; the executor and the
reference model read the same rules, so no table of tensor names is kept anywhere else.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

STATE_KINDS_ALL = ("param", "master", "exp_avg", "exp_avg_sq")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZERS = ("adam", "none")


class LayoutError(ValueError):
    """Input that no plan can be made for; the message says what to change."""


_DIM_RE = re.compile(r"(pp|tp|fsdp|hsdp|dp)(\d+)(?:x(\d+))?")
_GRAMMAR = "write it like pp4tp2dp1, tp2fsdp4 (FSDP2 over 4) or tp2hsdp2x2 (HSDP: 2 replicas of 2 shards); " \
    "order-free, missing dims are 1"


@dataclass(frozen=True)
class ParallelConfig:
    """A PP x DP x FSDP x TP grid: `dp` replicas of the state, each sharded `fsdp` ways (FSDP2; HSDP when
    both are > 1) and cut `tp` ways. Virtual rank order is torchtitan's mesh [pp, dp_replicate, dp_shard,
    tp]: TP fastest, then FSDP, then DP, then PP (Megatron's when fsdp is 1).

    A *class* is what one rank holds: (pp rank, fsdp rank, tp rank), class = (pp * fsdp + f) * tp + t; the
    dp replicas of a class hold the same state."""

    pp: int = 1
    tp: int = 1
    dp: int = 1
    fsdp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dp", "fsdp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def parse(cls, text: str) -> "ParallelConfig":
        """Parse `pp4tp2dp1`, `tp2pp4`, `dp3`, `tp2fsdp4`, `tp2hsdp2x2` ...: order-free, missing dimensions
        are 1; `hsdpRxS` is `dpR` replicas of `fsdpS` shards."""
        s = text.strip().lower()
        if not s:
            raise LayoutError(f"empty layout: {_GRAMMAR}")
        pos, dims = 0, {}
        for m in _DIM_RE.finditer(s):
            if m.start() != pos:
                break
            name, n, extra = m.group(1), int(m.group(2)), m.group(3)
            if (extra is not None) != (name == "hsdp"):
                break
            given = {"dp": n, "fsdp": int(extra)} if name == "hsdp" else {name: n}
            for k in given:
                if k in dims:
                    raise LayoutError(f"layout {text!r} names {k} twice (hsdpRxS is dpR with fsdpS)")
            dims.update(given)
            pos = m.end()
        if pos != len(s):
            raise LayoutError(f"cannot read layout {text!r}: {_GRAMMAR}")
        return cls(**dims)

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp * self.fsdp

    def rank(self, pp: int, dp: int, tp: int, fsdp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.fsdp + fsdp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a virtual rank (its fsdp rank: fsdp_rank)."""
        tp = rank % self.tp
        dp = (rank // (self.tp * self.fsdp)) % self.dp
        return rank // (self.tp * self.fsdp * self.dp), dp, tp

    def fsdp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.fsdp

    def data_rank(self, rank: int) -> int:
        """Which of the dp * fsdp parts of the batch a rank trains on: its replica's shards, then its shard."""
        return self.coords(rank)[1] * self.fsdp + self.fsdp_rank(rank)

    @property
    def classes(self) -> int:
        """How many different pieces of the state the layout holds (ranks of a class are its DP replicas)."""
        return self.pp * self.fsdp * self.tp

    @property
    def groups(self) -> int:
        """TP groups of one replica (pp * fsdp): the units a placement keeps inside a node."""
        return self.pp * self.fsdp

    def class_of(self, rank: int) -> int:
        pp, _dp, tp = self.coords(rank)
        return (pp * self.fsdp + self.fsdp_rank(rank)) * self.tp + tp

    def class_coords(self, cls: int) -> tuple[int, int, int]:
        """(pp, fsdp, tp) of a class."""
        group, tp = divmod(cls, self.tp)
        return group // self.fsdp, group % self.fsdp, tp

    def class_rank(self, cls: int, replica: int) -> int:
        """The rank of DP replica `replica` of class `cls`."""
        pp, f, tp = self.class_coords(cls)
        return self.rank(pp, replica, tp, f)

    def class_list(self) -> list[int]:
        """The class of every rank, in rank order."""
        return [self.class_of(r) for r in range(self.world_size)]

    def __str__(self) -> str:
        return f"pp{self.pp}tp{self.tp}dp{self.dp}" + (f"fsdp{self.fsdp}" if self.fsdp > 1 else "")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model: the block that owns it and the dimension TP splits (None: replicated)."""

    name: str
    block: str  # "embed", "layer", "head"
    layer: int  # layer index for block "layer", else -1
    shape: tuple[int, ...]
    tp_dim: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer and its optimizer, enough to know the bytes of every piece of state.

    Megatron-style TP: QKV and MLP fc1 are column-parallel (split dim 0, QKV rows grouped per
    head so a contiguous split keeps heads whole), attention proj and fc2 are row-parallel
    (split dim 1) with replicated biases, layer norms replicated, word embeddings and LM head
    split over the vocabulary.
    """

    layers: int
    hidden: int
    heads: int = 0
    ffn: int = 0
    vocab: int = 8192
    seq_len: int = 128
    dtype: str = "fp32"
    optimizer: str = "adam"
    _kinds: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())

    def flags(self) -> dict:
        """The model flags every worker of a job must agree on (launcher.runtime.join's model_info), and the
        dashboard's dry run reads from the job's launch spec."""
        return {k: getattr(self, k) for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq_len", "dtype", "optimizer")}

    def __post_init__(self) -> None:
        if self.heads == 0 and self.hidden > 0:
            object.__setattr__(self, "heads", max(1, self.hidden // 64))
        if self.ffn == 0 and self.hidden > 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        for name in ("layers", "hidden", "heads", "ffn", "vocab", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"model {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise LayoutError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.optimizer not in OPTIMIZERS:
            raise LayoutError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        kinds = ["param"]
        if self.optimizer == "adam":
            if self.dtype != "fp32":
                kinds.append("master")
            kinds += ["exp_avg", "exp_avg_sq"]
        object.__setattr__(self, "_kinds", tuple(kinds))

    @property
    def state_kinds(self) -> tuple[str, ...]:
        """Kinds of state each parameter carries: param, fp32 master if mixed precision, Adam moments."""
        return self._kinds

    def kind_bytes(self, kind: str) -> int:
        return DTYPE_BYTES[self.dtype] if kind == "param" else 4

    @property
    def bytes_per_element(self) -> int:
        return sum(self.kind_bytes(k) for k in self.state_kinds)

    def check_config(self, cfg: ParallelConfig) -> None:
        """Raise LayoutError when `cfg` cannot split this model evenly, or shards it over FSDP: the reference
        GPT worker replicates over DP (live mode runs FSDP layouts; `elastic plan` plans them by manifest)."""
        if cfg.fsdp > 1:
            raise LayoutError(f"{cfg}: the reference GPT worker does not run FSDP layouts (fsdp/hsdp); a script "
                              "under live mode (launcher.runtime) does")
        if self.layers % cfg.pp:
            raise LayoutError(f"{cfg}: {self.layers} layers are not divisible by pp={cfg.pp}")
        for name in ("heads", "ffn", "vocab"):
            if getattr(self, name) % cfg.tp:
                raise LayoutError(f"{cfg}: model {name}={getattr(self, name)} is not divisible by tp={cfg.tp}")

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        h, f, p = self.hidden, self.ffn, f"layers.{layer}."

        def t(name: str, shape: tuple[int, ...], tp_dim: int | None) -> TensorSpec:
            return TensorSpec(p + name, "layer", layer, shape, tp_dim)

        return [
            t("ln1.weight", (h,), None), t("ln1.bias", (h,), None),
            t("attn.qkv.weight", (3 * h, h), 0), t("attn.qkv.bias", (3 * h,), 0),
            t("attn.proj.weight", (h, h), 1), t("attn.proj.bias", (h,), None),
            t("ln2.weight", (h,), None), t("ln2.bias", (h,), None),
            t("mlp.fc1.weight", (f, h), 0), t("mlp.fc1.bias", (f,), 0),
            t("mlp.fc2.weight", (h, f), 1), t("mlp.fc2.bias", (h,), None),
        ]

    def embed_tensors(self) -> list[TensorSpec]:
        return [
            TensorSpec("embed.wte.weight", "embed", -1, (self.vocab, self.hidden), 0),
            TensorSpec("embed.wpe.weight", "embed", -1, (self.seq_len, self.hidden), None),
        ]

    def head_tensors(self) -> list[TensorSpec]:
        return [
            TensorSpec("head.ln_f.weight", "head", -1, (self.hidden,), None),
            TensorSpec("head.ln_f.bias", "head", -1, (self.hidden,), None),
            TensorSpec("head.lm_head.weight", "head", -1, (self.vocab, self.hidden), 0),
        ]

    def tensors(self) -> list[TensorSpec]:
        out = self.embed_tensors()
        for layer in range(self.layers):
            out += self.layer_tensors(layer)
        return out + self.head_tensors()

    def numel_by_part(self) -> dict[str, int]:
        """Elements per (block, part): the six numbers the byte cost model is built from."""
        def split(ts: list[TensorSpec]) -> tuple[int, int]:
            return (sum(t.numel for t in ts if t.tp_dim is not None), sum(t.numel for t in ts if t.tp_dim is None))

        ls, lr = split(self.layer_tensors(0))
        es, er = split(self.embed_tensors())
        hs, hr = split(self.head_tensors())
        return {"layer_sharded": ls, "layer_replicated": lr, "embed_sharded": es,
                "embed_replicated": er, "head_sharded": hs, "head_replicated": hr}

    @property
    def state_bytes(self) -> int:
        """Bytes of one full replica of the training state (every tensor once, every kind)."""
        return sum(t.numel for t in self.tensors()) * self.bytes_per_element
