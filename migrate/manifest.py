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
from functools import cached_property

import numpy as np

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1,
               "int8": 1, "bool": 1}


class ManifestError(ValueError):
    """State that a manifest cannot describe (e.g. a tensor sharded along two dimensions)."""


Cut = tuple[int, int, int]  # (dim, index, count): chunk `index` of `count` along `dim`


@dataclass(frozen=True)
class ShardEntry:
    """One piece of one tensor: `fqn` of global `shape`, cut into `count` chunks along `dim` (None:
    whole), of which this is chunk `index`; then, in turn, each cut of `inner` (dim, index, count)
    chunks what is left (FSDP2 shards dim 0 of a TP shard: a column-parallel weight of TP rank t is
    (0, t, T) then (0, f, F), a row-parallel one (1, t, T) then (0, f, F)). A piece is a box. `axes`
    names the mesh dimension of each cut where it is known ("tp", "fsdp": a checkpoint places the piece on
    its mesh by them); none means a single cut is TP's."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    dim: int | None = None
    index: int = 0
    count: int = 1
    inner: tuple[Cut, ...] = ()
    axes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ManifestError(f"{self.fqn}: unknown dtype {self.dtype!r}")
        if self.dim is None and self.inner:
            raise ManifestError(f"{self.fqn}: inner cuts {self.inner} of a piece that is not cut")
        for dim, index, count in self.cuts:
            if not 0 <= dim < len(self.shape):
                raise ManifestError(f"{self.fqn}: shard dim {dim} outside shape {self.shape}")
            if not 0 <= index < count:
                raise ManifestError(f"{self.fqn}: shard index {index} not in 0..{count - 1}")
        if self.axes and len(self.axes) != len(self.cuts):
            raise ManifestError(f"{self.fqn}: {len(self.axes)} axes {self.axes} for {len(self.cuts)} cuts")

    @property
    def cuts(self) -> tuple[Cut, ...]:
        """Every cut, outermost first (none for a whole piece)."""
        return () if self.dim is None else ((self.dim, self.index, self.count),) + tuple(self.inner)

    @cached_property
    def box(self) -> tuple[tuple[int, int], ...]:
        """[lo, hi) along every dimension: DTensor's Shard chunking (chunk = ceil(n / count)), cut after cut."""
        out = [(0, n) for n in self.shape]
        for dim, index, count in self.cuts:
            lo, hi = out[dim]
            chunk = -(-(hi - lo) // count)
            a = min(lo + index * chunk, hi)
            out[dim] = (a, min(a + chunk, hi))
        return tuple(out)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.box)

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict:
        d = {"fqn": self.fqn, "shape": list(self.shape), "dtype": self.dtype, "dim": self.dim,
             "index": self.index, "count": self.count}
        if self.inner:
            d["inner"] = [list(c) for c in self.inner]
        if self.axes:
            d["axes"] = list(self.axes)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "ShardEntry":
        return cls(d["fqn"], tuple(d["shape"]), d["dtype"], d["dim"], d["index"], d["count"],
                   tuple(tuple(c) for c in d.get("inner", ())), tuple(d.get("axes", ())))

    def cut_also(self, dim: int, index: int, count: int, axis: str = "") -> "ShardEntry":
        """This piece cut once more: chunk `index` of `count` along `dim` of what it holds, by mesh
        dimension `axis` (the cuts before it unnamed are TP's)."""
        if count == 1:
            return self
        axes = self.axes
        if axis:
            axes = (axes or ("tp",) * len(self.cuts)) + (axis,)
        elif axes:
            raise ManifestError(f"{self.fqn}: an unnamed cut after the named ones {axes}")
        (d, i, c), *inner = self.cuts + ((dim, index, count),)
        return ShardEntry(self.fqn, self.shape, self.dtype, d, i, c, tuple(inner), axes)

    def axis_of(self, i: int) -> str:
        """The mesh dimension of cut `i`: named, or TP's for a piece whose cuts are not named."""
        return self.axes[i] if self.axes else "tp"


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
    """Bytes of tensor `a.fqn` that both pieces hold: the intersection of their boxes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ManifestError(f"{a.fqn}: shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype} across layouts")
    return math.prod(max(min(ahi, bhi) - max(alo, blo), 0) for (alo, ahi), (blo, bhi) in zip(a.box, b.box)) \
        * DTYPE_BYTES[a.dtype]


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
    """The piece of `fqn` that tensor `t` is: a DTensor's placements give its cuts (mesh dimension by mesh
    dimension; a _StridedShard, FSDP2's over a TP shard of the same dim, cuts after the others), else whole."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    entry = ShardEntry(fqn, tuple(t.shape), _dtype_name(t.dtype))
    if not isinstance(t, DTensor):
        return entry
    mesh = t.device_mesh
    coords = mesh.get_coordinate() or [0] * mesh.ndim
    names = mesh.mesh_dim_names or ()
    plain, strided = [], []
    for mdim, p in enumerate(t.placements):
        if isinstance(p, (Shard, _StridedShard)):
            axis = names[mdim] if "fsdp" in names else ""  # named where FSDP makes it ambiguous
            (strided if isinstance(p, _StridedShard) else plain).append((p.dim, coords[mdim], mesh.size(mdim), axis))
        elif not p.is_replicate():
            raise ManifestError(f"{fqn}: placement {p} (only Shard(d) and Replicate are supported)")
    for cut in plain + strided:
        entry = entry.cut_also(*cut)
    return entry


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
                  optimizer: Callable | None = default_optimizer, fsdp: int = 1, fsdp_rank: int = 0) -> Manifest:
    """The manifest of one TP rank of a layout that no process holds: `module` is the model (or
    its PP stage) built on the meta device, `tp_plan` its `parallelize_module` plan (module FQN ->
    ColwiseParallel()/RowwiseParallel() or their class names); parameters outside the plan are
    replicated. With `fsdp` > 1, FSDP2's `fully_shard` over the TP-sharded module cuts dim 0 of every
    parameter's TP piece once more (chunk `fsdp_rank`), buffers stay whole. `optimizer(params)` is the script's optimizer factory (None: no optimizer state): its
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
    if fsdp > 1:
        params = dict(module.named_parameters())
        entries = [e.cut_also(0, fsdp_rank, fsdp, "fsdp") if e.fqn in params and e.shape else e for e in entries]
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
                out.append(ShardEntry(fqn, shape, dtype, e.dim, e.index, e.count, e.inner, e.axes))
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
    from migrate.workload import held_tensors, rank_workload

    _pp, _dp, tp = cfg.coords(rank)
    f = cfg.fsdp_rank(rank)
    w = rank_workload(cfg, rank, model.layers, cfg.tp)
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[model.dtype]
    entries = []
    for spec in held_tensors(model, w):
        for kind in model.state_kinds:
            sharded = spec.tp_dim is not None and cfg.tp > 1
            entries.append(ShardEntry(f"{kind}.{spec.name}", spec.shape, dtype if kind == "param" else "float32",
                                      spec.tp_dim if sharded else None, tp if sharded else 0,
                                      cfg.tp if sharded else 1).cut_also(0, f, cfg.fsdp, "fsdp"))
    return Manifest(tuple(entries))


def layout_manifests(cfg, produce) -> list[Manifest]:
    """One manifest per class (migrate.layout.ParallelConfig.class_of) of layout `cfg`: produce(rank) for
    the class's first DP rank (DP replicas hold the same state)."""
    return [produce(cfg.class_rank(c, 0)) for c in range(cfg.classes)]


def stage_manifests(cfg, build_stage, tp_plan: Mapping[str, object] | None,
                    optimizer: Callable | None = default_optimizer) -> list[Manifest]:
    """One manifest per class (pp rank, fsdp rank, tp rank) of layout `cfg` of any model:
    `build_stage(rank)` builds the pipeline stage of `rank` (under the whole model's FQNs), here on the
    meta device; `tp_plan` and the layout's FSDP cut it as in plan_manifest. DP replicas hold their
    class's manifest."""
    return layout_manifests(cfg, lambda r: plan_manifest(meta_module(build_stage, r), tp_plan, cfg.tp,
                                                         cfg.coords(r)[2], optimizer, cfg.fsdp, cfg.fsdp_rank(r)))
