"""State manifests: what one rank holds, named the torch-native way, so any model can be planned.

A manifest lists, for one rank, every tensor of training state it holds a piece of: the
fully-qualified name (a module's `state_dict` key, or `optim.state.<param fqn>.<key>` for an
optimizer's per-parameter state), the global shape, the dtype, and which piece: the dimension it
is sharded along (None: a whole replica), its shard index and the shard count, with DTensor's
`Shard(d)` chunking (chunk = ceil(n / count)). PP is in the names (a stage holds only its own
FQNs), TP in the shards, DP in the replicas (every DP rank has the same manifest).

Producers:
  * `module_manifest(module, optimizer)`: the state a process holds now, read from the module's
    `state_dict` (DTensor placements give the shards) and the optimizer's state;
  * `plan_manifest(module, tp_plan, tp, tp_rank)`: the state of a layout no process holds yet, from
    the model built on the meta device and its `parallelize_module` plan (ColwiseParallel shards
    weight and bias along dim 0, RowwiseParallel the weight along dim 1 with the bias whole) --
    the paper's meta-model approach, without a device mesh; the optimizer's state is what the script's
    optimizer factory creates (migrate.optim_state), any torch.optim class;
  * `stage_manifests(cfg, build_stage, tp_plan)`: every class (pp rank, tp rank) of a PP x DP x TP
    layout of any model, its pipeline stages built on the meta device;
  * `gpt_manifest(model, cfg, rank)`: the reference GPT (migrate.layout.ModelSpec).

`class_cost(rows, cols)` turns manifests into the planner's byte workload: cost[i, j] = the bytes
manifest rows[i] needs that cols[j] does not hold (the paper's len(curr) - len(curr & prev)).
Pure: torch is imported only by the producers that read modules.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1,
               "int8": 1, "bool": 1}


class ManifestError(ValueError):
    """State that a manifest cannot describe (e.g. a tensor sharded along two dimensions)."""


@dataclass(frozen=True)
class ShardEntry:
    """One piece of one tensor: `fqn` of global `shape`, cut into `count` chunks along `dim` (None:
    whole), of which this is chunk `index`."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    dim: int | None = None
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ManifestError(f"{self.fqn}: unknown dtype {self.dtype!r}")
        if self.dim is not None and not 0 <= self.dim < len(self.shape):
            raise ManifestError(f"{self.fqn}: shard dim {self.dim} outside shape {self.shape}")
        if not 0 <= self.index < self.count:
            raise ManifestError(f"{self.fqn}: shard index {self.index} not in 0..{self.count - 1}")

    @property
    def range(self) -> tuple[int, int]:
        """[lo, hi) along `dim` (DTensor's Shard chunking); the whole first dim when not sharded."""
        if self.dim is None:
            return 0, self.shape[0] if self.shape else 1
        n = self.shape[self.dim]
        chunk = -(-n // self.count)
        lo = min(self.index * chunk, n)
        return lo, min(lo + chunk, n)

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        lo, hi = self.range
        return tuple(hi - lo if d == self.dim else s for d, s in enumerate(self.shape))

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along `dim` (of the whole tensor when not sharded)."""
        rest = math.prod(s for d, s in enumerate(self.shape) if d != (self.dim or 0)) if self.shape else 1
        return rest * DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict:
        return {"fqn": self.fqn, "shape": list(self.shape), "dtype": self.dtype, "dim": self.dim,
                "index": self.index, "count": self.count}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ShardEntry":
        return cls(d["fqn"], tuple(d["shape"]), d["dtype"], d["dim"], d["index"], d["count"])


@dataclass(frozen=True)
class Manifest:
    """Everything one rank holds, in FQN order."""

    entries: tuple[ShardEntry, ...]

    def __post_init__(self) -> None:
        names = [e.fqn for e in self.entries]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ManifestError(f"a manifest names {dup[:3]} more than once")

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def by_fqn(self) -> dict[str, ShardEntry]:
        return {e.fqn: e for e in self.entries}

    def to_list(self) -> list[dict]:
        return [e.to_dict() for e in self.entries]

    @classmethod
    def from_list(cls, items: Iterable[Mapping]) -> "Manifest":
        return cls(tuple(ShardEntry.from_dict(d) for d in items))


def overlap(a: ShardEntry, b: ShardEntry) -> int:
    """Bytes of tensor `a.fqn` that both pieces hold."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ManifestError(f"{a.fqn}: shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype} across layouts")
    if a.dim is None:
        return b.nbytes
    if b.dim is None:
        return a.nbytes
    if a.dim == b.dim:
        (alo, ahi), (blo, bhi) = a.range, b.range
        return max(min(ahi, bhi) - max(alo, blo), 0) * a.row_bytes
    shape = list(a.shape)  # a box: a's range along a.dim, b's along b.dim
    for e in (a, b):
        lo, hi = e.range
        shape[e.dim] = hi - lo
    return math.prod(shape) * DTYPE_BYTES[a.dtype]


def shared_bytes(rows: Sequence[Manifest], cols: Sequence[Manifest]) -> np.ndarray:
    """shared[i, j] = bytes that rows[i] and cols[j] both hold."""
    out = np.zeros((len(rows), len(cols)), dtype=np.int64)
    col_maps = [c.by_fqn() for c in cols]
    for i, r in enumerate(rows):
        for e in r.entries:
            for j, cm in enumerate(col_maps):
                other = cm.get(e.fqn)
                if other is not None:
                    out[i, j] += overlap(e, other)
    return out


def class_cost(rows: Sequence[Manifest], cols: Sequence[Manifest]) -> np.ndarray:
    """cost[i, j] = bytes rows[i] needs that cols[j] does not hold: the planner's byte workload."""
    need = np.array([m.nbytes for m in rows], dtype=np.int64)
    return need[:, None] - shared_bytes(rows, cols)


# -- producers ---------------------------------------------------------------------------------
def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def tensor_entry(fqn: str, t) -> ShardEntry:
    """The piece of `fqn` that tensor `t` is: a DTensor's placements give its shard, else whole."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return ShardEntry(fqn, tuple(t.shape), _dtype_name(t.dtype))
    mesh, dim, index, count = t.device_mesh, None, 0, 1
    coords = mesh.get_coordinate() or [0] * mesh.ndim
    for mdim, p in enumerate(t.placements):
        if isinstance(p, Shard):
            if dim is not None:
                raise ManifestError(f"{fqn}: sharded on two mesh dimensions ({t.placements}); a manifest "
                                    "holds one shard dimension")
            dim, index, count = p.dim, coords[mdim], mesh.size(mdim)
        elif not p.is_replicate():
            raise ManifestError(f"{fqn}: placement {p} (only Shard(d) and Replicate are supported)")
    return ShardEntry(fqn, tuple(t.shape), _dtype_name(t.dtype), dim, index, count)


def optimizer_entries(module, optimizer) -> list[ShardEntry]:
    """`optim.state.<param fqn>.<key>` for every tensor of the optimizer's per-parameter state."""
    names = {id(p): n for n, p in module.named_parameters()}
    out = []
    for p, st in optimizer.state.items():
        for key in sorted(st):
            v = st[key]
            if hasattr(v, "shape"):
                out.append(tensor_entry(f"optim.state.{names[id(p)]}.{key}", v))
    return out


def module_manifest(module, optimizer=None) -> Manifest:
    """The state this process holds: the module's state_dict, plus the optimizer's state."""
    entries = [tensor_entry(k, v) for k, v in module.state_dict().items()]
    if optimizer is not None:
        entries += optimizer_entries(module, optimizer)
    return Manifest(tuple(entries))


#: parallelize_module style name -> (weight shard dim, bias shard dim) of an nn.Linear
STYLE_DIMS = {"ColwiseParallel": (0, 0), "RowwiseParallel": (1, None)}

def default_optimizer(params):
    """The optimizer a manifest describes when its caller names none: torch.optim.Adam."""
    import torch

    return torch.optim.Adam(params)


def plan_manifest(module, tp_plan: Mapping[str, object] | None, tp: int, tp_rank: int,
                  optimizer: Callable | None = default_optimizer) -> Manifest:
    """The manifest of one TP rank of a layout that no process holds: `module` is the model (or
    its PP stage) built on the meta device, `tp_plan` its `parallelize_module` plan (module FQN ->
    ColwiseParallel()/RowwiseParallel() or their class names); parameters outside the plan are
    replicated. `optimizer(params)` is the script's optimizer factory (None: no optimizer state): its
    per-parameter state is learnt from the optimizer itself (migrate.optim_state), each tensor shaped
    like its parameter cut like it, every other one (a scalar `step`, Adafactor's factored moments of an
    unsharded matrix) whole on every rank."""
    styles = {}
    for name, style in (tp_plan or {}).items():
        kind = style if isinstance(style, str) else type(style).__name__
        if kind not in STYLE_DIMS:
            raise ManifestError(f"tp plan: {name}: style {kind} (supported: {', '.join(STYLE_DIMS)})")
        styles[name] = STYLE_DIMS[kind]
    entries = []
    for fqn, t in module.state_dict().items():
        owner, _, leaf = fqn.rpartition(".")
        dims = styles.get(owner)
        dim = None if dims is None or tp == 1 else (dims[0] if leaf == "weight" else dims[1] if leaf == "bias" else None)
        entries.append(ShardEntry(fqn, tuple(t.shape), _dtype_name(t.dtype), dim, tp_rank if dim is not None else 0,
                                  tp if dim is not None else 1))
    if optimizer is not None:
        entries += planned_optimizer_entries(module, {e.fqn: e for e in entries}, optimizer)
    return Manifest(tuple(entries))


def planned_optimizer_entries(module, pieces: Mapping[str, ShardEntry], optimizer: Callable) -> list[ShardEntry]:
    """`optim.state.<param>.<key>` of every parameter of `module` whose piece is `pieces[param]`, as
    `optimizer(params)` keeps it (migrate.optim_state.state_shapes). What DTensor does with state shaped
    otherwise than its sharded parameter is not known here: ManifestError (torch's own Adafactor cannot
    step a DTensor matrix either)."""
    from migrate.optim_state import StateError, state_shapes

    named = list(module.named_parameters())
    try:
        shapes = state_shapes(named, optimizer)
    except StateError as exc:
        raise ManifestError(str(exc)) from None
    out = []
    for name, _p in named:
        e = pieces[name]
        for key, (shape, dtype) in shapes[name].items():
            fqn = f"optim.state.{name}.{key}"
            if shape == e.shape:
                out.append(ShardEntry(fqn, shape, dtype, e.dim, e.index, e.count))
            elif e.dim is None or shape == ():
                out.append(ShardEntry(fqn, shape, dtype))
            else:
                raise ManifestError(f"{fqn}: shape {shape} for a parameter of shape {e.shape} sharded along dim "
                                    f"{e.dim}: under TP live mode moves per-parameter state shaped like its "
                                    "parameter, or scalars")
    return out


def meta_module(build, *args, **kwargs):
    """Call `build(*args, **kwargs)` with the meta device as default: shapes and names, no memory."""
    import torch

    with torch.device("meta"):
        return build(*args, **kwargs)


def gpt_manifest(model, cfg, rank: int) -> Manifest:
    """The reference GPT's state on virtual rank `rank` of `cfg` (migrate.layout's rules): every
    state kind (param, master, Adam moments) of every tensor its stage holds, TP shards by rank."""
    from migrate.state import held_tensors, rank_workload

    _pp, _dp, tp = cfg.coords(rank)
    w = rank_workload(cfg, rank, model.layers, cfg.tp)
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[model.dtype]
    entries = []
    for spec in held_tensors(model, w):
        for kind in model.state_kinds:
            sharded = spec.tp_dim is not None and cfg.tp > 1
            entries.append(ShardEntry(f"{kind}.{spec.name}", spec.shape, dtype if kind == "param" else "float32",
                                      spec.tp_dim if sharded else None, tp if sharded else 0, cfg.tp if sharded else 1))
    return Manifest(tuple(entries))


def layout_manifests(cfg, produce) -> list[Manifest]:
    """One manifest per class (pp * tp + tp_rank) of layout `cfg`: produce(rank) for the class's first
    DP rank (DP replicas hold the same state)."""
    return [produce(cfg.rank(p, 0, t)) for p in range(cfg.pp) for t in range(cfg.tp)]


def stage_manifests(cfg, build_stage, tp_plan: Mapping[str, object] | None,
                    optimizer: Callable | None = default_optimizer) -> list[Manifest]:
    """One manifest per class (pp rank * tp + tp rank) of layout `cfg` of any model: `build_stage(rank)`
    builds the pipeline stage of `rank` (under the whole model's FQNs), here on the meta device;
    `tp_plan` cuts it as in plan_manifest. DP replicas hold their class's manifest."""
    return layout_manifests(cfg, lambda r: plan_manifest(meta_module(build_stage, r), tp_plan, cfg.tp,
                                                         cfg.coords(r)[2], optimizer))
