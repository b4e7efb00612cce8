"""Send / Recv / Refer instructions (paper III-D) and how their sources are chosen.

A `Segment` names a piece of state by layout rules, not by tensor names: a block (a range of
layers, the embedding or the head), its TP-sharded or replicated part, and for the sharded
part a slice [lo, hi) of `of` equal units along each tensor's TP dimension. Pieces that come
from the same source stage and TP rank are kept as one segment: that is the coalescing.
"""
from __future__ import annotations

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


Key = tuple  # ("class", old class) for TP-sharded pieces, ("stage", old stage) for replicated ones


class Needs:
    """What a rank of one class keeps and lacks on a device of one kind, memoised per (class, kind).

    Ranks of the same class on devices of the same kind need the same segments, so the plan is
    made per class and a worker expands only its own instructions from it.
    """

    def __init__(self, prev: ParallelConfig, layers: int, units: int, bm: ByteModel) -> None:
        self.prev, self.units, self.bm = prev, units, bm
        self.stage_layers = layers // prev.pp
        self.tp_units = units // prev.tp
        self._memo: dict[tuple, tuple[tuple[Segment, ...], tuple[tuple[Segment, Key], ...]]] = {}

    def of(self, want: Workload, have: Workload | None) -> tuple[tuple[Segment, ...], tuple[tuple[Segment, Key], ...]]:
        """(segments kept in place, (segment, key of its holders) to receive)."""
        memo = self._memo.get((want, have))
        if memo is None:
            memo = self._compute(want, have)
            self._memo[(want, have)] = memo
        return memo

    def _compute(self, want: Workload, have: Workload | None):
        refers: list[Segment] = []
        missing: list[tuple[Segment, Key]] = []
        lay_want = (want.layer_lo, want.layer_hi)
        sl_want = (want.slice_lo, want.slice_hi)
        lay_have = (have.layer_lo, have.layer_hi) if have else (0, 0)
        sl_have = (have.slice_lo, have.slice_hi) if have else (0, 0)
        both = _cap(lay_want, lay_have)
        if both:
            s = _cap(sl_want, sl_have)
            if s:
                refers.append(Segment("layers", "sharded", *both, *s, self.units))
            refers.append(Segment("layers", "replicated", *both))
            for s_missing in _minus(sl_want, sl_have):
                missing += self._sharded("layers", both, s_missing)
        for lay_missing in _minus(lay_want, lay_have):
            missing += self._sharded("layers", lay_missing, sl_want)
            missing += self._replicated("layers", lay_missing)
        for block, flag in (("embed", "first"), ("head", "last")):
            if not getattr(want, flag):
                continue
            stage = 0 if block == "embed" else self.prev.pp - 1
            if have and getattr(have, flag):
                s = _cap(sl_want, sl_have)
                if s:
                    refers.append(Segment(block, "sharded", 0, 0, *s, self.units))
                refers.append(Segment(block, "replicated"))
                for s_missing in _minus(sl_want, sl_have):
                    missing += self._sharded(block, None, s_missing, stage)
            else:
                missing += self._sharded(block, None, sl_want, stage)
                missing += self._replicated(block, None, stage)
        return tuple(refers), tuple(missing)

    def _stages(self, layers: Interval | None, stage: int | None) -> list[tuple[int, Interval]]:
        return _cut(layers, self.stage_layers) if layers else [(stage, (0, 0))]

    def _sharded(self, block: str, layers: Interval | None, slices: Interval, stage: int | None = None):
        return [(Segment(block, "sharded", *lay, *sl, self.units), ("class", p * self.prev.tp + t))
                for p, lay in self._stages(layers, stage) for t, sl in _cut(slices, self.tp_units)]

    def _replicated(self, block: str, layers: Interval | None, stage: int | None = None):
        return [(Segment(block, "replicated", *lay), ("stage", p)) for p, lay in self._stages(layers, stage)]


def check_lost(needs: Needs, curr_ws: list[Workload], prev_ws: list[Workload], pairs: list[tuple[int, int | None]],
               alive_classes: set[int], failed_holders: dict[int, list[int]]) -> None:
    """Raise LostStateError when a needed piece has no surviving holder.

    `pairs`: the (new class, old class of the device or None) combinations a placement uses;
    `alive_classes`: old classes some surviving device holds.
    """
    tp = needs.prev.tp
    alive_stages = {c // tp for c in alive_classes}
    lost: dict[int, set[str]] = {}
    for c_new, have in pairs:
        for seg, k in needs.of(curr_ws[c_new], None if have is None else prev_ws[have])[1]:
            if k[1] not in (alive_classes if k[0] == "class" else alive_stages):
                c = k[1] if k[0] == "class" else k[1] * tp
                lost.setdefault(c, set()).add(seg.describe())
    if lost:
        raise LostStateError([
            f"pp stage {c // tp} tp rank {c % tp} ({', '.join(sorted(what))}) "
            f"was only on failed device(s) {sorted(failed_holders.get(c, []))}"
            for c, what in sorted(lost.items())])


class Expander:
    """Instructions of a placement, derived deterministically from it (every process gets the same).

    The receivers of each key, in device order, take its holders in turn (receiver j gets holder
    j mod H), so the sending is shared by the surviving replicas, and one device's instructions
    are expanded without building anyone else's: ranks are grouped by (new class, old kind).
    """

    def __init__(self, prev: ParallelConfig, prev_devices: tuple[int, ...], curr: ParallelConfig,
                 curr_devices: tuple[int, ...], failed: frozenset[int], layers: int, units: int, bm: ByteModel,
                 kinds: tuple[str, ...]) -> None:
        import numpy as np

        from migrate.workload import class_workloads

        self.np = np
        self.prev, self.curr, self.curr_devices, self.bm, self.kinds = prev, curr, curr_devices, bm, kinds
        self.prev_ws = class_workloads(prev, layers, units)
        self.curr_ws = class_workloads(curr, layers, units)
        self.needs = Needs(prev, layers, units, bm)
        n_dev = max(max(prev_devices, default=0), max(curr_devices, default=0)) + 1
        ranks = np.arange(prev.world_size)
        self.dev_class = np.full(n_dev, -1, dtype=np.int64)  # old class a surviving device holds, -1: none
        self.dev_class[list(prev_devices)] = (ranks // (prev.tp * prev.dp)) * prev.tp + ranks % prev.tp
        self.dev_class[[d for d in failed if d < n_dev]] = -1
        self.curr_dev = np.asarray(curr_devices, dtype=np.int64)
        r = np.arange(curr.world_size)
        self.rank_class = (r // (curr.tp * curr.dp)) * curr.tp + r % curr.tp
        self.rank_kind = self.dev_class[self.curr_dev]
        pair = self.rank_class * (len(self.prev_ws) + 1) + (self.rank_kind + 1)
        self.pair_of_rank = pair
        self.pairs = {int(p): self._pair_needs(int(p)) for p in np.unique(pair)}
        self._holders: dict[Key, list[int]] = {}
        self._receivers: dict[Key, list[int]] = {}

    def _pair_needs(self, pair: int):
        c, k = divmod(pair, len(self.prev_ws) + 1)
        return self.needs.of(self.curr_ws[c], self.prev_ws[k - 1] if k else None)

    def holders(self, key: Key) -> list[int]:
        out = self._holders.get(key)
        if out is None:
            if key[0] == "class":
                mask = self.dev_class == key[1]
            else:
                mask = (self.dev_class >= 0) & (self.dev_class // self.prev.tp == key[1])
            out = self._holders[key] = self.np.flatnonzero(mask).tolist()
        return out

    def receivers(self, key: Key) -> list[int]:
        """Devices that receive a piece of `key`, in device order."""
        out = self._receivers.get(key)
        if out is None:
            wanted = [p for p, (_refers, missing) in self.pairs.items() if any(k == key for _s, k in missing)]
            mask = self.np.isin(self.pair_of_rank, wanted)
            out = self._receivers[key] = self.np.sort(self.curr_dev[mask]).tolist()
        return out

    def keys(self) -> list[Key]:
        return list(dict.fromkeys(k for _refers, missing in self.pairs.values() for _s, k in missing))

    def _source(self, key: Key, index: int) -> int:
        holders = self.holders(key)
        return holders[index % len(holders)]

    def _rank_on(self) -> dict[int, int]:
        return {d: r for r, d in enumerate(self.curr_devices)}

    def all(self) -> list[Instruction]:
        out: list[Instruction] = []
        for r, dst in enumerate(self.curr_devices):
            out += [Instruction("refer", dst, dst, self.kinds, seg, seg.nbytes(self.bm))
                    for seg in self.pairs[int(self.pair_of_rank[r])][0]]
        rank_on = self._rank_on()
        for key in self.keys():
            for j, dst in enumerate(self.receivers(key)):
                src = self._source(key, j)
                for seg, k in self.pairs[int(self.pair_of_rank[rank_on[dst]])][1]:
                    if k == key:
                        n = seg.nbytes(self.bm)
                        out.append(Instruction("send", src, dst, self.kinds, seg, n))
                        out.append(Instruction("recv", src, dst, self.kinds, seg, n))
        return out

    def for_device(self, device: int) -> list[Instruction]:
        """The instructions `device` takes part in: its refers and receives, and the sends it makes."""
        out: list[Instruction] = []
        hits = self.np.flatnonzero(self.curr_dev == device)
        if len(hits):
            refers, missing = self.pairs[int(self.pair_of_rank[hits[0]])]
            out += [Instruction("refer", device, device, self.kinds, seg, seg.nbytes(self.bm)) for seg in refers]
            for seg, k in missing:
                src = self._source(k, self.receivers(k).index(device))
                out.append(Instruction("recv", src, device, self.kinds, seg, seg.nbytes(self.bm)))
        c = int(self.dev_class[device]) if device < len(self.dev_class) else -1
        if c >= 0:
            for key in (("class", c), ("stage", c // self.prev.tp)):
                holders = self.holders(key)
                dsts = self.receivers(key)[holders.index(device)::len(holders)]
                if not dsts:
                    continue
                rank_of = dict(zip(self.curr_dev[self.np.isin(self.curr_dev, dsts)].tolist(),
                                   self.pair_of_rank[self.np.isin(self.curr_dev, dsts)].tolist()))
                for dst in dsts:
                    for seg, k in self.pairs[rank_of[dst]][1]:
                        if k == key:
                            out.append(Instruction("send", device, dst, self.kinds, seg, seg.nbytes(self.bm)))
        return out

    def traffic(self) -> tuple[dict[int, int], dict[int, int], dict[str, int]]:
        """Bytes each device sends and receives, and instruction counts per op, without building them."""
        np = self.np
        send: dict[int, int] = {}
        counts = {"send": 0, "recv": 0, "refer": 0}
        pair_ids = np.array(sorted(self.pairs), dtype=np.int64)
        index = np.searchsorted(pair_ids, self.pair_of_rank)
        refers = np.array([len(self.pairs[int(p)][0]) for p in pair_ids], dtype=np.int64)
        recv_b = np.array([sum(seg.nbytes(self.bm) for seg, _k in self.pairs[int(p)][1]) for p in pair_ids],
                          dtype=np.int64)
        n_recv = np.array([len(self.pairs[int(p)][1]) for p in pair_ids], dtype=np.int64)
        counts["refer"] = int(refers[index].sum())
        counts["send"] = counts["recv"] = int(n_recv[index].sum())
        recv = {int(d): int(b) for d, b in zip(self.curr_dev, recv_b[index]) if b}
        dev_pair = dict(zip(self.curr_dev.tolist(), self.pair_of_rank.tolist()))
        for key in self.keys():
            holders = self.holders(key)
            per_pair = {p: sum(seg.nbytes(self.bm) for seg, k in self.pairs[p][1] if k == key) for p in self.pairs}
            dsts = self.receivers(key)
            b = np.array([per_pair[dev_pair[d]] for d in dsts], dtype=np.int64)
            for h, src in enumerate(holders):
                total = int(b[h::len(holders)].sum())
                if total:
                    send[src] = send.get(src, 0) + total
        return send, recv, counts


class LostStateError(LayoutError):
    """Some state has no surviving copy: only a checkpoint can bring it back."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        shown = "; ".join(pieces[:4]) + (f"; and {len(pieces) - 4} more" if len(pieces) > 4 else "")
        super().__init__(f"state lost, no surviving DP replica holds it: {shown}. "
                         "Restore from the last checkpoint instead of migrating.")
