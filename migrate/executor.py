"""Runs a `MigrationPlan` on one device: the reference GPT's Send/Recv/Refer instructions, moved by
the shared transfer layer (migrate.transfer) that the manifest engine (migrate.reshard) uses too.

A device expands only its own instructions (`MigrationPlan.instructions_for`) into pieces, one per
(tensor, state kind, slice range), named by a key its peer derives alike; the transfer layer sends
them straight from the old tensors into the new ones (allocated ahead by `prepare_targets` when the
worker learns of the migration), packs the small ones per peer, and works in windows of bounded
memory. Refers reuse the old tensor object when the shard is unchanged.

The old state is never modified (unless `release_early`): a failure anywhere leaves every device on
its old layout. The new state is only adopted after every device has verified its checksums and voted.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from migrate.checksum import unit_digest
from migrate.layout import ModelSpec, TensorSpec
from migrate.plan import MigrationPlan
from migrate.reshard import allocates_ahead
from migrate.state import LocalState, TORCH_DTYPES, local_shape, shard_range
from migrate.workload import held_tensors, rank_workload
from migrate.transfer import WINDOW_BYTES, Exchange, TransferError, narrow_is_contiguous
from migrate.workload import Workload

CHUNK_BYTES = 64 << 20
MIN_CHUNK_BYTES = 256 << 10
EARLY_SHARE = 0.05  # window traffic as a share of the smallest new shard when old tensors are released early


def auto_chunk_bytes(plan: MigrationPlan, share: float = EARLY_SHARE) -> int:
    """Window size when old tensors are released early: `share` of the smallest new shard, at most 64
    MiB, so that little new state arrives before old state is released. (The safe mode, which holds old
    and new state anyway, bounds only its staging memory: migrate.transfer.WINDOW_BYTES.)"""
    from migrate.workload import ByteModel, class_workloads

    needs = ByteModel.of_model(plan.model, plan.units).need(
        class_workloads(plan.curr.layout, plan.model.layers, plan.units))
    return int(max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, int(needs.min() * share))))


def _whole_refer(spec: TensorSpec, old_w: Workload | None, new_w: Workload | None) -> bool:
    """The device keeps this tensor's shard unchanged: the new state takes the very old tensor."""
    return old_w is not None and new_w is not None and local_shape(spec, old_w) == local_shape(spec, new_w) \
        and shard_range(spec, old_w) == shard_range(spec, new_w)


def prepare_targets(plan: MigrationPlan, device: int,
                    release_early: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """The new tensors `device` will fill, allocated and written once now, so that the transfer lands in
    memory that is already mapped (receiving into fresh memory is 3-8x slower on CPU, facts.md).
    Called before the pause (a worker does it when it learns of the migration, while it still trains),
    it takes the page faults out of the pause. Tensors the device keeps unchanged are not allocated, and
    none where the device does not allocate ahead (migrate.reshard.allocates_ahead: with `release_early`
    only a joiner does)."""
    model, units = plan.model, plan.units
    old_rank, new_rank = plan.prev.rank_of().get(device), plan.curr.rank_of().get(device)
    if not allocates_ahead(old_rank, new_rank, release_early):
        return {}
    old_w = rank_workload(plan.prev.layout, old_rank, model.layers, units) if old_rank is not None else None
    new_w = rank_workload(plan.curr.layout, new_rank, model.layers, units)
    dtype = _dtypes(model)
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in model.state_kinds}
    for p in device_pieces(plan, device):
        if p.dst != device or p.spec.name in out[p.kind]:
            continue
        if p.src == device and _whole_refer(p.spec, old_w, new_w):
            continue
        out[p.kind][p.spec.name] = torch.zeros(local_shape(p.spec, new_w), dtype=dtype[p.kind])
    return out


class MigrationError(RuntimeError):
    """The migration did not complete; the device's old state is intact."""


@dataclass(frozen=True)
class Piece:
    """One tensor-kind slice moving from src to dst (refer: src == dst): slice units [lo, hi) of it."""

    order: int
    src: int
    dst: int
    spec: TensorSpec
    kind: str
    lo: int  # slice units of the plan (ignored for replicated tensors)
    hi: int
    nbytes: int

    @property
    def key(self) -> tuple:
        """What sender and receiver both call this piece (migrate.transfer orders messages by it)."""
        return (self.order, self.src, self.dst, self.lo, self.hi)


@dataclass
class ExecResult:
    state: LocalState | None
    phases: dict[str, float]
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_bytes: int = 0
    steady_bytes: int = 0
    units_verified: int = 0
    targets_unused: int = 0  # tensors allocated ahead (prepare_targets) that the plan did not fill
    notes: list[str] = field(default_factory=list)


def _dtypes(model: ModelSpec) -> dict[str, torch.dtype]:
    return {k: TORCH_DTYPES[model.dtype] if k == "param" else torch.float32 for k in model.state_kinds}


@functools.lru_cache(maxsize=64)
def _tensor_order(model: ModelSpec) -> dict[str, int]:
    """Model order of every tensor name (memoised: a worker asks before and inside the pause)."""
    return {t.name: i for i, t in enumerate(model.tensors())}


@functools.lru_cache(maxsize=4096)
def _segment_specs(model: ModelSpec, seg) -> list[TensorSpec]:
    if seg.block == "layers":
        specs = [t for layer in range(seg.layer_lo, seg.layer_hi) for t in model.layer_tensors(layer)]
    else:
        specs = model.embed_tensors() if seg.block == "embed" else model.head_tensors()
    return [t for t in specs if (t.tp_dim is None) == (seg.part == "replicated")]


def _piece_bytes(spec: TensorSpec, lo: int, hi: int, units: int, kind_bytes: int) -> int:
    n = kind_bytes
    for d, s in enumerate(spec.shape):
        n *= s // units * (hi - lo) if d == spec.tp_dim else s
    return n


def device_pieces(plan: MigrationPlan, device: int) -> list[Piece]:
    """The pieces `device` refers, receives and sends, from its own instructions only (every device
    derives the same pieces, with the same keys, for the transfers it shares with another)."""
    model = plan.model
    order = _tensor_order(model)
    kinds = {k: i for i, k in enumerate(model.state_kinds)}
    out: list[Piece] = []
    for ins in plan.instructions_for(device):
        seg = ins.segment
        for spec in _segment_specs(model, seg):
            for kind in ins.kinds:
                n = _piece_bytes(spec, seg.slice_lo, seg.slice_hi, plan.units, model.kind_bytes(kind))
                out.append(Piece(order[spec.name] * len(kinds) + kinds[kind], ins.src, ins.dst, spec, kind,
                                 seg.slice_lo, seg.slice_hi, n))
    out.sort(key=lambda p: p.key)
    return out


def _view(t: torch.Tensor, spec: TensorSpec, w: Workload, lo: int, hi: int, units: int) -> torch.Tensor:
    """The part of local shard `t` (held by workload w) covering slice units [lo, hi)."""
    if spec.tp_dim is None:
        return t
    unit = spec.shape[spec.tp_dim] // units
    w_lo = w.slice_lo * units // w.of
    return t.narrow(spec.tp_dim, (lo - w_lo) * unit, (hi - lo) * unit)


def _view_contiguous(spec: TensorSpec, w: Workload, lo: int, hi: int, units: int) -> bool:
    """Whether `_view` of a contiguous shard is contiguous, without the tensor."""
    if spec.tp_dim is None:
        return True
    return narrow_is_contiguous(local_shape(spec, w), spec.tp_dim, spec.shape[spec.tp_dim] // units * (hi - lo))


class _Ledger:
    """Bytes of state alive on this device, to report the peak against the steady state."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        self.live += t.nbytes
        self.peak = max(self.peak, self.live)

    def drop(self, t: torch.Tensor) -> None:
        self.live -= t.nbytes


class DeviceExecutor:
    """One device's part of a plan, run on the shared transfer layer (migrate.transfer)."""

    def __init__(self, plan: MigrationPlan, device: int, state: LocalState | None,
                 world_rank: Mapping[int, int] | None = None, chunk_bytes: int | None = None,
                 on_round: Callable[[int], None] | None = None, release_early: bool = False,
                 targets: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        self.plan, self.device, self.old = plan, device, state
        self.on_round = on_round  # fault injection in tests: called before each window
        # release_early: drop each old tensor once its receivers confirmed their copies (lower peak
        # memory, but a failure half way then leaves this device without all of its old state)
        self.release_early = release_early
        # gloo moves CPU tensors, NCCL moves GPU tensors: new state lives where the backend sends from
        self.torch_device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
        self.world_rank = world_rank or {d: d for d in range(len(plan.topology.devices))}
        self.chunk_bytes = chunk_bytes or (auto_chunk_bytes(plan) if release_early else WINDOW_BYTES)
        model, units = plan.model, plan.units
        old_rank = plan.prev.rank_of().get(device)
        self.old_w = rank_workload(plan.prev.layout, old_rank, model.layers, units) if old_rank is not None else None
        self.new_rank = plan.curr.rank_of().get(device)
        self.new_w = rank_workload(plan.curr.layout, self.new_rank, model.layers, units) if self.new_rank is not None else None
        if device in plan.failed:
            raise MigrationError(f"device {device} is marked failed in the plan and cannot take part")
        if self.old_w is not None and state is None:
            raise MigrationError(f"device {device} ran old rank {old_rank} but has no state to migrate")
        self.targets = targets or {}  # new tensors allocated ahead (prepare_targets), by kind and name

    def run(self) -> ExecResult:
        model, units = self.plan.model, self.plan.units
        ledger = _Ledger()
        if self.old is not None:
            for per in self.old.tensors.values():
                for t in per.values():
                    ledger.add(t)
        old_bytes = ledger.live
        new: dict[str, dict[str, torch.Tensor]] = {k: {} for k in model.state_kinds}
        dtype = _dtypes(model)

        def tensor(kind: str, name: str, spec: TensorSpec) -> torch.Tensor:
            t = new[kind].get(name)
            if t is None:
                t = self.targets.get(kind, {}).pop(name, None)
                if t is None or t.device != self.torch_device:
                    t = torch.empty(local_shape(spec, self.new_w), dtype=dtype[kind], device=self.torch_device)
                new[kind][name] = t
                ledger.add(t)
            return t

        def release(owner: tuple[str, str]) -> None:
            t = self.old.tensors[owner[0]].pop(owner[1], None)
            if t is not None and new[owner[0]].get(owner[1]) is not t:
                ledger.drop(t)

        rank = self.world_rank  # peers by rank in the default world
        ex = Exchange(None, self.chunk_bytes, release if self.release_early else None)
        kept: set[tuple[str, str]] = set()
        for p in device_pieces(self.plan, self.device):
            if p.src == p.dst:
                src = self.old.tensors[p.kind][p.spec.name]
                if _whole_refer(p.spec, self.old_w, self.new_w):
                    new[p.kind][p.spec.name] = src  # unchanged shard: keep the very tensor
                    kept.add((p.kind, p.spec.name))
                else:
                    ex.copy(_view(tensor(p.kind, p.spec.name, p.spec), p.spec, self.new_w, p.lo, p.hi, units),
                            _view(src, p.spec, self.old_w, p.lo, p.hi, units), (p.kind, p.spec.name))
            elif p.src == self.device:
                t = _view(self.old.tensors[p.kind][p.spec.name], p.spec, self.old_w, p.lo, p.hi, units)
                ex.send(rank[p.dst], p.key, t, (p.kind, p.spec.name))
            else:
                ex.recv(rank[p.src], p.key,
                        lambda p=p: _view(tensor(p.kind, p.spec.name, p.spec), p.spec, self.new_w, p.lo, p.hi, units),
                        p.nbytes, _view_contiguous(p.spec, self.new_w, p.lo, p.hi, units))
        if self.release_early and self.old is not None:
            for kind, per in self.old.tensors.items():
                for name in per:
                    if (kind, name) not in kept:
                        ex.own((kind, name))
        try:
            stats = ex.run(self.on_round)
        except TransferError as exc:
            raise _TransferFailed(str(exc)) from exc
        state = None
        if self.new_w is not None:
            missing = [(k, s.name) for s in held_tensors(model, self.new_w) for k in model.state_kinds
                       if s.name not in new[k]]
            if missing:
                raise MigrationError(f"device {self.device}: the plan left {len(missing)} tensors unfilled, e.g. {missing[:3]}")
            state = LocalState(new, self.old.step if self.old else -1, dict(self.old.meta) if self.old else {})
        new_bytes = state.nbytes() if state else 0
        unused = sum(len(per) for per in self.targets.values())
        return ExecResult(state, {}, stats.bytes_sent, stats.bytes_received, ledger.peak + stats.staging_bytes,
                          max(old_bytes, new_bytes), targets_unused=unused)


class _TransferFailed(RuntimeError):
    """The transfer layer failed (a peer died): reported by `execute` with what was kept."""


def unit_checksums(model: ModelSpec, state: LocalState, w: Workload, units: int) -> dict[tuple[str, str, int], int]:
    """Checksum (migrate.checksum) of every (tensor, kind, slice unit) a device holds; replicated tensors are unit -1."""
    out: dict[tuple[str, str, int], int] = {}
    for spec in held_tensors(model, w):
        for kind, per in state.tensors.items():
            t = per[spec.name]
            if spec.tp_dim is None:
                out[(spec.name, kind, -1)] = unit_digest(t)
                continue
            lo = w.slice_lo * units // w.of
            hi = w.slice_hi * units // w.of
            for k in range(lo, hi):
                out[(spec.name, kind, k)] = unit_digest(_view(t, spec, w, k, k + 1, units))
    return out


def _judge(gathered: list, verify: bool) -> tuple[list[str], int, dict | None]:
    """Failures (empty when every device may commit), the step, and the metadata new ranks take."""
    failures = [f"device {d}: {r}" for d, good, r, *_ in gathered if not good]
    steps = {s for *_x, s, _m in gathered if s is not None}
    if len(steps) > 1:
        failures.append(f"old ranks are at different steps {sorted(steps)}")
    # run-wide metadata (RNG state, data position) travels from the lowest old device to joiners
    metas = [m for *_x, m in sorted(gathered, key=lambda g: g[0]) if m is not None]
    if verify:
        expected: dict = {}
        for d, _good, _r, before, *_ in gathered:
            for key, h in before.items():
                if expected.setdefault(key, h) != h:
                    failures.append(f"replicas disagree on {key[0]} {key[1]} unit {key[2]} before migrating")
        for d, _good, _r, _b, after, *_ in gathered:
            bad = [k for k, h in after.items() if expected.get(k) != h]
            if bad:
                failures.append(f"device {d}: {len(bad)} state units differ from the old layout, e.g. {bad[:3]}")
    return failures, (steps.pop() if steps else 0), (metas[0] if metas else None)


def execute(plan: MigrationPlan, device: int, state: LocalState | None, world_rank: Mapping[int, int] | None = None,
            chunk_bytes: int | None = None, verify: bool = True, group=None,
            on_round: Callable[[int], None] | None = None, release_early: bool = False,
            targets: dict[str, dict[str, torch.Tensor]] | None = None) -> ExecResult:
    """Run this device's part of `plan` and verify the result; all devices of the plan must call it.

    Returns the new state (None on a device that leaves). Raises MigrationError on any failure
    or mismatch on any device, in which case every device keeps its old `state` untouched.
    """
    model, units = plan.model, plan.units
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        ex = DeviceExecutor(plan, device, state, world_rank, chunk_bytes, on_round, release_early, targets)
        before: dict = {}
        if verify and ex.old_w is not None:
            before = unit_checksums(model, state, ex.old_w, units)
        t1 = time.perf_counter()
        result = ex.run()
        t2 = time.perf_counter()
        phases["execute"] = t2 - t1
        ok, reason = True, ""
        if result.state is not None and verify:
            after = unit_checksums(model, result.state, ex.new_w, units)
        else:
            after = {}
        step = state.step if state is not None else None
        meta = state.meta if state is not None else None
    except MigrationError as exc:
        ok, reason, result, before, after, step, meta = False, str(exc), None, {}, {}, None, None
        t2 = time.perf_counter()
    except _TransferFailed as exc:  # a dead peer shows up here as a gloo error
        kept = ("old state partially released (release_early): recover it from replicas or a checkpoint"
                if release_early else "old layout kept")
        raise MigrationError(f"device {device}: transfer failed ({exc}); {kept}") from exc
    # One device judges for all: it gathers every vote, checksum, step and metadata, checks them
    # once, and broadcasts the verdict (checking on every device costs n times the CPU).
    size = dist.get_world_size(group)
    judge = dist.get_global_rank(group, 0) if group is not None else 0
    gathered: list | None = [None] * size if dist.get_rank() == judge else None
    try:
        dist.gather_object((device, ok, reason, before, after, step, meta), gathered, dst=judge, group=group)
        verdict = [_judge(gathered, verify) if gathered is not None else None]
        dist.broadcast_object_list(verdict, src=judge, group=group)
    except Exception as exc:
        raise MigrationError(f"device {device}: lost contact during the commit vote ({exc}); old layout kept") from exc
    failures, step_after, meta_after = verdict[0]
    if failures:
        raise MigrationError("migration aborted, old layout kept: " + "; ".join(failures[:5]))
    phases["other"] = time.perf_counter() - t0 - phases["execute"]
    if result.state is not None:
        result.state.step = step_after
        if not result.state.meta and meta_after is not None:
            result.state.meta = dict(meta_after)
    result.phases = phases
    result.units_verified = len(after)
    return result
