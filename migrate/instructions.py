"""Send / Recv / Refer instructions (paper III-D) and how their sources are chosen.

A `Segment` names a piece of state by layout rules, not by tensor names: a block (a range of
layers, the embedding or the head), its TP-sharded or replicated part, and for the sharded
part a slice [lo, hi) of `of` equal units along each tensor's TP dimension. Pieces that come
from the same source stage and TP rank are kept as one segment: that is the coalescing.
"""
from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass

from migrate.layout import LayoutError, ParallelConfig
from migrate.workload import ByteModel, Workload

Interval = tuple[int, int]


@dataclass(frozen=True, order=True)
class Segment:
    block: str  # "layers" | "embed" | "head"
    part: str  # "sharded" | "replicated"
    layer_lo: int = 0
    layer_hi: int = 0
    slice_lo: int = 0
    slice_hi: int = 1
    of: int = 1

    def nbytes(self, bm: ByteModel) -> int:
        width = self.slice_hi - self.slice_lo
        per = {("layers", "sharded"): bm.layer_s * width, ("layers", "replicated"): bm.layer_r,
               ("embed", "sharded"): bm.embed_s * width, ("embed", "replicated"): bm.embed_r,
               ("head", "sharded"): bm.head_s * width, ("head", "replicated"): bm.head_r}[(self.block, self.part)]
        return per * (self.layer_hi - self.layer_lo) if self.block == "layers" else per

    def describe(self) -> str:
        where = f"layers {self.layer_lo}-{self.layer_hi - 1}" if self.block == "layers" else self.block
        return f"{where} {self.part}" + (f" slices {self.slice_lo}-{self.slice_hi - 1}/{self.of}" if self.part == "sharded" else "")


@dataclass(frozen=True)
class Instruction:
    """One step of the migration. Send runs on `src`, Recv on `dst`, Refer keeps local state (src == dst)."""

    op: str  # "send" | "recv" | "refer"
    src: int
    dst: int
    kinds: tuple[str, ...]
    segment: Segment
    nbytes: int

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kinds"] = list(self.kinds)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Instruction":
        return cls(d["op"], d["src"], d["dst"], tuple(d["kinds"]), Segment(**d["segment"]), d["nbytes"])


def _minus(a: Interval, b: Interval) -> list[Interval]:
    out = []
    if a[0] < min(a[1], b[0]):
        out.append((a[0], min(a[1], b[0])))
    if max(a[0], b[1]) < a[1]:
        out.append((max(a[0], b[1]), a[1]))
    return out if b[0] < b[1] else [a]


def _cap(a: Interval, b: Interval) -> Interval | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _cut(iv: Interval, step: int) -> list[tuple[int, Interval]]:
    """Split an interval at multiples of `step`; returns (index of the step, piece)."""
    out, lo = [], iv[0]
    while lo < iv[1]:
        hi = min(iv[1], (lo // step + 1) * step)
        out.append((lo // step, (lo, hi)))
        lo = hi
    return out


class InstructionBuilder:
    """Turns a placement into instructions, choosing the least-loaded holder for every missing piece."""

    def __init__(self, prev: ParallelConfig, layers: int, units: int, bm: ByteModel, kinds: tuple[str, ...],
                 holders: dict[int, list[int]], failed_holders: dict[int, list[int]] | None = None) -> None:
        # holders[old class] = alive devices that hold it; failed_holders: failed devices that did
        self.prev, self.units, self.bm, self.kinds, self.holders = prev, units, bm, kinds, holders
        self.stage_layers = layers // prev.pp
        self.tp_units = units // prev.tp
        self.refers: list[Instruction] = []
        self.failed_holders = failed_holders or {}
        self.missing: list[tuple[int, Segment, tuple]] = []  # (dst, segment, key of its candidate sources)
        self.sources: dict[tuple, list[int]] = {}
        self.lost: dict[int, set[str]] = {}  # old class -> what of it is needed

    def add_rank(self, dst: int, want: Workload, have: Workload | None) -> None:
        lay_want = (want.layer_lo, want.layer_hi)
        sl_want = (want.slice_lo, want.slice_hi)
        lay_have = (have.layer_lo, have.layer_hi) if have else (0, 0)
        sl_have = (have.slice_lo, have.slice_hi) if have else (0, 0)
        both = _cap(lay_want, lay_have)
        if both:
            s = _cap(sl_want, sl_have)
            if s:
                self._refer(dst, Segment("layers", "sharded", *both, *s, self.units))
            self._refer(dst, Segment("layers", "replicated", *both))
            for s_missing in _minus(sl_want, sl_have):
                self._need_sharded("layers", dst, both, s_missing)
        for lay_missing in _minus(lay_want, lay_have):
            self._need_sharded("layers", dst, lay_missing, sl_want)
            self._need_replicated("layers", dst, lay_missing)
        for block, flag in (("embed", "first"), ("head", "last")):
            if not getattr(want, flag):
                continue
            stage = 0 if block == "embed" else self.prev.pp - 1
            if have and getattr(have, flag):
                s = _cap(sl_want, sl_have)
                if s:
                    self._refer(dst, Segment(block, "sharded", 0, 0, *s, self.units))
                self._refer(dst, Segment(block, "replicated"))
                for s_missing in _minus(sl_want, sl_have):
                    self._need_sharded(block, dst, None, s_missing, stage)
            else:
                self._need_sharded(block, dst, None, sl_want, stage)
                self._need_replicated(block, dst, None, stage)

    def _refer(self, dev: int, seg: Segment) -> None:
        self.refers.append(Instruction("refer", dev, dev, self.kinds, seg, seg.nbytes(self.bm)))

    def _stages(self, layers: Interval | None, stage: int | None) -> list[tuple[int, Interval]]:
        return _cut(layers, self.stage_layers) if layers else [(stage, (0, 0))]

    def _need_sharded(self, block: str, dst: int, layers: Interval | None, slices: Interval,
                      stage: int | None = None) -> None:
        for p, lay in self._stages(layers, stage):
            for t, sl in _cut(slices, self.tp_units):
                seg = Segment(block, "sharded", *lay, *sl, self.units)
                key = ("class", p * self.prev.tp + t)
                if key not in self.sources:
                    self.sources[key] = self.holders.get(key[1], [])
                if not self.sources[key]:
                    self.lost.setdefault(key[1], set()).add(seg.describe())
                self.missing.append((dst, seg, key))

    def _need_replicated(self, block: str, dst: int, layers: Interval | None, stage: int | None = None) -> None:
        for p, lay in self._stages(layers, stage):
            key = ("stage", p)
            if key not in self.sources:
                self.sources[key] = [d for t in range(self.prev.tp) for d in self.holders.get(p * self.prev.tp + t, [])]
            if not self.sources[key]:
                self.lost.setdefault(p * self.prev.tp, set()).add(Segment(block, "replicated", *lay).describe())
            self.missing.append((dst, Segment(block, "replicated", *lay), key))

    def build(self) -> list[Instruction]:
        """Assign sources largest piece first to the least-loaded holder; raise if a piece has none."""
        load: dict[int, int] = {}
        out: list[Instruction] = list(self.refers)
        if self.lost:
            raise LostStateError([
                f"pp stage {c // self.prev.tp} tp rank {c % self.prev.tp} ({', '.join(sorted(what))}) "
                f"was only on failed device(s) {sorted(self.failed_holders.get(c, []))}"
                for c, what in sorted(self.lost.items())])
        # one lazy min-heap of (load, device) per candidate set; loads only grow, so stale tops are re-pushed
        heaps = {key: [(0, d) for d in sorted(devs)] for key, devs in self.sources.items()}
        for dst, seg, key in sorted(self.missing, key=lambda m: -m[1].nbytes(self.bm)):
            nbytes = seg.nbytes(self.bm)
            heap = heaps[key]
            while heap[0][0] != load.get(heap[0][1], 0):
                _, dev = heapq.heappop(heap)
                heapq.heappush(heap, (load.get(dev, 0), dev))
            src = heap[0][1]
            load[src] = load.get(src, 0) + nbytes
            heapq.heapreplace(heap, (load[src], src))
            out.append(Instruction("send", src, dst, self.kinds, seg, nbytes))
            out.append(Instruction("recv", src, dst, self.kinds, seg, nbytes))
        return out


class LostStateError(LayoutError):
    """Some state has no surviving copy: only a checkpoint can bring it back."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        shown = "; ".join(pieces[:4]) + (f"; and {len(pieces) - 4} more" if len(pieces) > 4 else "")
        super().__init__(f"state lost, no surviving DP replica holds it: {shown}. "
                         "Restore from the last checkpoint instead of migrating.")
