"""Runs a `MigrationPlan` on one device with torch.distributed point-to-point operations.

Every device derives the same global schedule from the plan: tensor pieces in model order,
cut into rounds that move at most `chunk_bytes` into or out of any one device. In a round a
device posts all its sends and receives with `batch_isend_irecv` and waits, so memory in
flight is bounded and no device can wait on a peer that is still in an earlier round.
Receives land in one buffer allocated once and reused (receiving into fresh memory is the
slow path on CPU); refers reuse the old tensor object when the shard is unchanged.

The old state is never modified: a failure anywhere leaves every device on its old layout.
The new state is only adopted after every device has verified its checksums and voted.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from migrate.checksum import unit_digest
from migrate.layout import ModelSpec, TensorSpec
from migrate.plan import MigrationPlan
from migrate.state import LocalState, TORCH_DTYPES, held_tensors, local_shape, rank_workload, shard_range
from migrate.workload import Workload

CHUNK_BYTES = 64 << 20
MIN_CHUNK_BYTES = 256 << 10


SAFE_SHARE = 0.25  # round size as a share of the smallest new shard, old state kept until the commit
EARLY_SHARE = 0.05  # ... when old tensors are released as they are sent (the 1.1x memory goal)


def auto_chunk_bytes(plan: MigrationPlan, share: float = EARLY_SHARE) -> int:
    """Round size: `share` of the smallest new shard, at most 64 MiB. Only the column-slice buffer and
    the senders' contiguous copies scale with it; every round costs a synchronisation of its pairs, so
    the safe mode, which holds old and new state anyway, takes fewer and larger rounds."""
    from migrate.workload import ByteModel, class_workloads

    needs = ByteModel.of_model(plan.model, plan.units).need(
        class_workloads(plan.curr.layout, plan.model.layers, plan.units))
    return int(max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, int(needs.min() * share))))


def _whole_refer(spec: TensorSpec, old_w: Workload | None, new_w: Workload | None) -> bool:
    """The device keeps this tensor's shard unchanged: the new state takes the very old tensor."""
    return old_w is not None and new_w is not None and local_shape(spec, old_w) == local_shape(spec, new_w) \
        and shard_range(spec, old_w) == shard_range(spec, new_w)


def prepare_targets(plan: MigrationPlan, device: int, chunk_bytes: int | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """The new tensors `device` will fill, allocated and written once now, so that the transfer lands in
    memory that is already mapped (receiving into fresh memory is 3-8x slower on CPU, facts.md).
    Called before the pause (a worker does it when it learns of the migration, while it still trains),
    it takes the page faults out of the pause. Tensors the device keeps unchanged are not allocated."""
    model, units = plan.model, plan.units
    old_rank, new_rank = plan.prev.rank_of().get(device), plan.curr.rank_of().get(device)
    if new_rank is None:
        return {}
    old_w = rank_workload(plan.prev.layout, old_rank, model.layers, units) if old_rank is not None else None
    new_w = rank_workload(plan.curr.layout, new_rank, model.layers, units)
    dtype = {k: TORCH_DTYPES[model.dtype] if k == "param" else torch.float32 for k in model.state_kinds}
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in model.state_kinds}
    for rnd in schedule(plan, chunk_bytes):
        for p in rnd:
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
    """One tensor-kind slice moving from src to dst (refer: src == dst), rows [row_lo, row_hi) of it."""

    order: int
    src: int
    dst: int
    spec: TensorSpec
    kind: str
    lo: int  # slice units of the plan (ignored for replicated tensors)
    hi: int
    row_lo: int
    row_hi: int
    nbytes: int


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


def _segment_specs(model: ModelSpec, seg) -> list[TensorSpec]:
    if seg.block == "layers":
        specs = [t for layer in range(seg.layer_lo, seg.layer_hi) for t in model.layer_tensors(layer)]
    else:
        specs = model.embed_tensors() if seg.block == "embed" else model.head_tensors()
    return [t for t in specs if (t.tp_dim is None) == (seg.part == "replicated")]


def _piece_rows(spec: TensorSpec, lo: int, hi: int, units: int) -> tuple[int, int]:
    """Rows (dim 0) of the piece, and elements per row: pieces are chunked by rows."""
    shape = list(spec.shape)
    if spec.tp_dim is not None:
        shape[spec.tp_dim] = shape[spec.tp_dim] // units * (hi - lo)
    rows = shape[0]
    per_row = 1
    for s in shape[1:]:
        per_row *= s
    return rows, per_row


def schedule(plan: MigrationPlan, chunk_bytes: int | None = None) -> list[list[Piece]]:
    """The global, deterministic list of rounds every device executes its part of."""
    model = plan.model
    chunk_bytes = chunk_bytes or auto_chunk_bytes(plan)
    order = {t.name: i for i, t in enumerate(model.tensors())}
    kinds = {k: i for i, k in enumerate(model.state_kinds)}
    pieces: list[Piece] = []
    for ins in plan.instructions:
        if ins.op == "recv":
            continue  # the send describes the same transfer
        for spec in _segment_specs(model, ins.segment):
            for kind in ins.kinds:
                rows, per_row = _piece_rows(spec, ins.segment.slice_lo, ins.segment.slice_hi, plan.units)
                row_bytes = per_row * model.kind_bytes(kind)
                step = rows if ins.op == "refer" else max(1, chunk_bytes // max(1, row_bytes))
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    pieces.append(Piece(order[spec.name] * len(kinds) + kinds[kind], ins.src, ins.dst, spec, kind,
                                        ins.segment.slice_lo, ins.segment.slice_hi, r0, r1, (r1 - r0) * row_bytes))
    pieces.sort(key=lambda p: (p.order, p.src, p.dst, p.lo, p.row_lo))
    rounds: list[list[Piece]] = [[]]
    load: dict[int, int] = {}
    for p in pieces:
        if p.src != p.dst:
            if rounds[-1] and (load.get(p.src, 0) + p.nbytes > chunk_bytes or load.get(p.dst, 0) + p.nbytes > chunk_bytes):
                rounds.append([])
                load = {}
            load[p.src] = load.get(p.src, 0) + p.nbytes
            load[p.dst] = load.get(p.dst, 0) + p.nbytes
        rounds[-1].append(p)
    return [r for r in rounds if r]


def _view(t: torch.Tensor, spec: TensorSpec, w: Workload, lo: int, hi: int, units: int) -> torch.Tensor:
    """The part of local shard `t` (held by workload w) covering slice units [lo, hi)."""
    if spec.tp_dim is None:
        return t
    unit = spec.shape[spec.tp_dim] // units
    w_lo = w.slice_lo * units // w.of
    return t.narrow(spec.tp_dim, (lo - w_lo) * unit, (hi - lo) * unit)


class _Ledger:
    """Bytes of state and buffers alive on this device, to report the peak against the steady state."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        if key not in self.live:
            self.live[key] = t.untyped_storage().nbytes()
            self.peak = max(self.peak, sum(self.live.values()))

    def drop(self, t: torch.Tensor) -> None:
        self.live.pop(t.untyped_storage().data_ptr(), None)


class DeviceExecutor:
    """One device's part of a plan."""

    def __init__(self, plan: MigrationPlan, device: int, state: LocalState | None,
                 world_rank: Mapping[int, int] | None = None, chunk_bytes: int | None = None,
                 on_round: Callable[[int], None] | None = None, release_early: bool = False,
                 targets: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        self.plan, self.device, self.old = plan, device, state
        self.on_round = on_round  # fault injection in tests
        # release_early: drop each old tensor after its last use (lower peak memory, but a failure
        # half way then leaves this device without its old state)
        self.release_early = release_early
        # gloo moves CPU tensors, NCCL moves GPU tensors: new state lives where the backend sends from
        self.torch_device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
        self.world_rank = world_rank or {d: d for d in range(len(plan.topology.devices))}
        self.chunk_bytes = chunk_bytes or auto_chunk_bytes(plan, EARLY_SHARE if release_early else SAFE_SHARE)
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
        old_bytes = sum(ledger.live.values())
        new: dict[str, dict[str, torch.Tensor]] = {k: {} for k in model.state_kinds}
        dtype = {k: TORCH_DTYPES[model.dtype] if k == "param" else torch.float32 for k in model.state_kinds}
        mine = [[p for p in r if self.device in (p.src, p.dst)] for r in schedule(self.plan, self.chunk_bytes)]
        buf_bytes = max((sum(p.nbytes for p in r if p.dst == self.device and p.src != self.device
                             and p.spec.tp_dim == 1) for r in mine), default=0)
        buffer = torch.empty(buf_bytes, dtype=torch.uint8, device=self.torch_device)
        ledger.add(buffer)
        sent = received = 0

        last_use: dict[tuple[str, str], int] = {}
        for round_no, rnd in enumerate(mine):
            for p in rnd:
                if p.src == self.device:
                    last_use[(p.kind, p.spec.name)] = round_no

        def target(p: Piece) -> torch.Tensor:
            t = new[p.kind].get(p.spec.name)
            if t is None:
                t = self.targets.get(p.kind, {}).pop(p.spec.name, None)
                if t is None or t.device != self.torch_device:
                    t = torch.empty(local_shape(p.spec, self.new_w), dtype=dtype[p.kind], device=self.torch_device)
                new[p.kind][p.spec.name] = t
                ledger.add(t)
            return _view(t, p.spec, self.new_w, p.lo, p.hi, units)[p.row_lo:p.row_hi]

        for round_no, rnd in enumerate(mine):
            if self.on_round is not None:
                self.on_round(round_no)
            ops, copies, temps, offset = [], [], [], 0
            for p in rnd:
                if p.src == p.dst:
                    src = self.old.tensors[p.kind][p.spec.name]
                    if _whole_refer(p.spec, self.old_w, self.new_w):
                        new[p.kind][p.spec.name] = src  # unchanged shard: keep the very tensor
                    else:
                        target(p).copy_(_view(src, p.spec, self.old_w, p.lo, p.hi, units))
                elif p.src == self.device:
                    t = _view(self.old.tensors[p.kind][p.spec.name], p.spec, self.old_w, p.lo, p.hi, units)
                    t = t[p.row_lo:p.row_hi]
                    if not t.is_contiguous():
                        t = t.contiguous()
                        temps.append(t)
                        ledger.add(t)
                    ops.append(dist.P2POp(dist.isend, t, self.world_rank[p.dst]))
                    sent += p.nbytes
                else:
                    dst = target(p)
                    if dst.is_contiguous():  # straight into the new tensor
                        ops.append(dist.P2POp(dist.irecv, dst, self.world_rank[p.src]))
                    else:  # a column slice: through the reused buffer
                        view = buffer[offset:offset + p.nbytes].view(dst.dtype).view(dst.shape)
                        offset += p.nbytes
                        ops.append(dist.P2POp(dist.irecv, view, self.world_rank[p.src]))
                        copies.append((dst, view))
                    received += p.nbytes
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            for dst, view in copies:
                dst.copy_(view)
            for t in temps:
                ledger.drop(t)
            if self.release_early:
                for (kind, name), last in list(last_use.items()):
                    if last == round_no:
                        t = self.old.tensors[kind].pop(name)
                        if new[kind].get(name) is not t:
                            ledger.drop(t)
                        del t
        ledger.drop(buffer)
        del buffer
        state = None
        if self.new_w is not None:
            missing = [(k, s.name) for s in held_tensors(model, self.new_w) for k in model.state_kinds
                       if s.name not in new[k]]
            if missing:
                raise MigrationError(f"device {self.device}: the plan left {len(missing)} tensors unfilled, e.g. {missing[:3]}")
            state = LocalState(new, self.old.step if self.old else -1, dict(self.old.meta) if self.old else {})
        new_bytes = state.nbytes() if state else 0
        unused = sum(len(per) for per in self.targets.values())
        return ExecResult(state, {}, sent, received, ledger.peak, max(old_bytes, new_bytes), targets_unused=unused)


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
    except Exception as exc:  # a dead peer shows up here as a gloo error
        kept = ("old state partially released (release_early): recover it from replicas or a checkpoint"
                if release_early else "old layout kept")
        raise MigrationError(f"device {device}: transfer failed ({type(exc).__name__}: {exc}); {kept}") from exc
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
