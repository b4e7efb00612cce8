"""Move any model's training state from one layout to another, between running processes, by manifest.

The reference GPT has its own planner and executor (migrate.plan, migrate.executor); this is the
path for every other model, described only by per-rank manifests (migrate.manifest): for each
piece a new rank needs, `plan_transfers` picks old holders (the same process first, then the
least loaded one) and the exact index range each sends; `execute` runs the transfers between
processes in one batch of point-to-point sends and receives, copying locally what a process
already holds. Planning is pure; only `execute` touches torch.distributed.

What a process does around the pause (the API a runtime wires in):

    transfers = plan_transfers(old_ms, new_ms, same)                     # pure, every process alike
    entries = plan_targets(transfers, old_rank, new_rank, old_m, new_m)   # pure: what to allocate ahead
    targets = allocate_targets(entries)                                   # before the pause (page faults)
    local = plan_local(transfers, old_rank, new_rank, old_m, new_m)       # pure: this process's part
    ready = prepare_transfer(transfers, old_rank, new_rank, old_state, old_m, new_m,
                             targets=targets, local=local)                # before the pause: views cut
    new = execute(transfers, old_rank, new_rank, old_state, old_m, new_m, procs_old, procs_new,
                  targets=targets, local=local, release_early=False, verify=True,
                  prepared=ready)                                          # the pause
    new.units_verified, new.kept, new.phases                              # what to record

A piece the process already holds whole and unchanged (`kept_pieces`) is not allocated nor copied:
the new state takes the very old tensor. `verify` compares xxh3 digests of every message between
processes at both ends (the sender's of the bytes it cut from its old tensors by its manifest and
handed over, the receiver's of the bytes that arrived: a direct message's from its new tensor after
the last window) and every process raises the same MigrationMismatch when any differs, old state kept.

A piece is a box of its tensor (migrate.manifest.ShardEntry: DTensor Shard(d)/Replicate, FSDP2's cut of
a TP shard), and so is every transfer: along one dimension when both layouts cut the tensor along the
same one (TP to TP), a box otherwise (TP to FSDP x TP: a row-parallel weight is cut by columns on one
side, by rows and columns on the other).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from migrate.manifest import DTYPE_BYTES, Manifest, ManifestError, ShardEntry


class MigrationMismatch(RuntimeError):
    """A transferred piece arrived different from what was sent (digests differ): nothing is adopted.
    (A dead peer raises migrate.transfer.TransferError instead; planning here stays free of torch.)"""


Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, order=True)
class Transfer:
    """The elements `box` ([lo, hi) along every dimension of the whole tensor) of `fqn`, from old rank
    `src` to new rank `dst`."""

    fqn: str
    dst: int
    src: int
    box: Box

    @property
    def numel(self) -> int:
        return math.prod(hi - lo for lo, hi in self.box)


def _cap(a: Box, b: Box) -> Box | None:
    out = tuple((max(alo, blo), min(ahi, bhi)) for (alo, ahi), (blo, bhi) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _cells(want: Box, boxes: Sequence[Box]) -> list[Box]:
    """`want` cut at every edge of `boxes` inside it, in row-major order: each cell lies wholly inside or
    wholly outside each box."""
    import itertools

    cuts = []
    for d, (lo, hi) in enumerate(want):
        edges = sorted({lo, hi} | {x for b in boxes for x in b[d] if lo < x < hi})
        cuts.append(list(zip(edges, edges[1:])))
    return [tuple(c) for c in itertools.product(*cuts)]


def _inside(cell: Box, box: Box) -> bool:
    return all(blo <= lo and hi <= bhi for (lo, hi), (blo, bhi) in zip(cell, box))


def plan_transfers(old: Sequence[Manifest], new: Sequence[Manifest], same: Mapping[int, int]) -> list[Transfer]:
    """Who sends what: `old[r]` is what old rank r holds, `new[r]` what new rank r needs, `same[new rank]`
    the old rank on the same process (if any). Each needed box is cut at the edges of the old pieces
    over it; each cell comes from a holder (the same process first, then the least loaded), and the cells
    a holder sends one receiver are one transfer where they make a box (its whole share of the need).
    Raises ManifestError when some piece has no holder."""
    holders: dict[str, dict[Box, list[int]]] = {}  # fqn -> box -> the old ranks holding it (replicas)
    shapes: dict[str, tuple[int, ...]] = {}
    for r, m in enumerate(old):
        for e in m.entries:
            holders.setdefault(e.fqn, {}).setdefault(e.box, []).append(r)
            shapes[e.fqn] = e.shape
    load = [0] * len(old)
    out: list[Transfer] = []
    for dst, m in enumerate(new):
        mine = same.get(dst)
        for need in m.entries:
            have = holders.get(need.fqn)
            if not have:
                raise ManifestError(f"{need.fqn}: no process holds it in the old layout")
            if shapes[need.fqn] != need.shape:
                raise ManifestError(f"{need.fqn}: shape {shapes[need.fqn]} in the old layout, {need.shape} in the new")
            want = need.box
            if any(lo >= hi for lo, hi in want):
                continue  # an empty shard (more chunks than rows): nothing to fill
            over = [(cap, ranks) for box, ranks in have.items() if (cap := _cap(box, want)) is not None]
            if len(over) == 1 and over[0][0] == want:  # one box of holders covers it all: the common case
                cap, ranks = over[0]
                r = min(ranks, key=lambda x: (x != mine, load[x], x))
                if r != mine:
                    load[r] += need.nbytes
                out.append(Transfer(need.fqn, dst, r, want))
                continue
            caps = [cap for cap, _ranks in over]
            chosen: dict[int, list[Box]] = {}
            inside = [0] * len(over)  # cells inside each box of holders
            group_of: dict[int, int] = {}
            for cell in _cells(want, caps):
                cover = [g for g, cap in enumerate(caps) if _inside(cell, cap)]
                if not cover:
                    raise ManifestError(f"{need.fqn}: elements {cell} are held by no old rank")
                for g in cover:
                    inside[g] += 1
                r, g = min(((x, g) for g in cover for x in over[g][1]), key=lambda xg: (xg[0] != mine, load[xg[0]], xg[0]))
                group_of[r] = g
                chosen.setdefault(r, []).append(cell)
                if r != mine:
                    load[r] += math.prod(hi - lo for lo, hi in cell) * DTYPE_BYTES[need.dtype]
            for r, cells in sorted(chosen.items(), key=lambda x: x[1][0]):
                if len(cells) == inside[group_of[r]]:  # the holder's whole share: one box
                    out.append(Transfer(need.fqn, dst, r, caps[group_of[r]]))
                else:
                    out += [Transfer(need.fqn, dst, r, c) for c in cells]
    return out


def kept_pieces(transfers: Sequence[Transfer], old_rank: int | None, new_rank: int | None,
                old_manifest: Manifest | None, new_manifest: Manifest | None) -> frozenset[str]:
    """FQNs this process holds already, whole and unchanged (same elements, dtype), and fills only from
    itself: the new state takes the very old tensor (no allocation, no copy)."""
    if old_rank is None or new_rank is None or old_manifest is None or new_manifest is None:
        return frozenset()
    olds = old_manifest.by_fqn()
    sources: dict[str, set[int]] = {}
    for t in transfers:
        if t.dst == new_rank:
            sources.setdefault(t.fqn, set()).add(t.src)
    return frozenset(e.fqn for e in new_manifest.entries
                     if sources.get(e.fqn) == {old_rank} and e.fqn in olds
                     and olds[e.fqn].dtype == e.dtype and olds[e.fqn].box == e.box)


def allocates_ahead(old_rank: int | None, new_rank: int | None, release_early: bool) -> bool:
    """Whether the process that is old rank `old_rank` and new rank `new_rank` (None: none) allocates its
    new tensors before the pause. Every process that gets new state does, but with `release_early` memory
    comes first: a process holding old state makes its new tensors only as old ones go, while a joiner
    (no old state: its new tensors are all it will hold, whenever they are made) still allocates ahead.
    The rule of both engines (plan_targets here, migrate.executor.prepare_targets for the reference GPT)."""
    return new_rank is not None and not (release_early and old_rank is not None)


def plan_targets(transfers: Sequence[Transfer], old_rank: int | None, new_rank: int | None,
                 old_manifest: Manifest | None, new_manifest: Manifest | None,
                 release_early: bool = False) -> tuple[ShardEntry, ...]:
    """The new pieces to allocate ahead (`allocate_targets`, before the pause) on the process that is
    old rank `old_rank` and new rank `new_rank`: every piece of its new manifest but the kept ones, or
    none where it does not allocate ahead (`allocates_ahead`)."""
    if new_manifest is None or not allocates_ahead(old_rank, new_rank, release_early):
        return ()
    kept = kept_pieces(transfers, old_rank, new_rank, old_manifest, new_manifest)
    return tuple(e for e in new_manifest.entries if e.fqn not in kept)


def allocate_targets(entries: Sequence[ShardEntry], device=None) -> dict[str, object]:
    """Tensors for `entries` (plan_targets), written once so their pages are mapped: receiving into
    fresh memory is 3-8x slower on CPU (facts.md). Give them to `execute(..., targets=...)`."""
    import torch

    return {e.fqn: torch.zeros(e.local_shape, dtype=getattr(torch, e.dtype), device=device) for e in entries}


def plan_staging(transfers: Sequence[Transfer], old_rank: int | None, new_rank: int | None,
                 old_manifest: Manifest | None, new_manifest: Manifest | None, release_early: bool = False,
                 window_bytes: int | None = None) -> tuple[int, int]:
    """Bytes of staging (received, sent) that `execute` on this process may need at most
    (migrate.transfer.staging_bound over the pieces it will send and receive). Pure;
    `allocate_staging` makes them."""
    from migrate.transfer import EARLY_WINDOW_BYTES, WINDOW_BYTES, staging_bound, view_is_contiguous

    olds = old_manifest.by_fqn() if old_manifest is not None else {}
    news = new_manifest.by_fqn() if new_manifest is not None else {}
    kept = kept_pieces(transfers, old_rank, new_rank, old_manifest, new_manifest)
    pieces = []
    for tr in transfers:
        if tr.src == old_rank and tr.dst != new_rank:
            incoming, peer, e = False, tr.dst, olds[tr.fqn]
        elif tr.dst == new_rank and tr.src != old_rank and tr.fqn not in kept:
            incoming, peer, e = True, tr.src, news[tr.fqn]
        else:
            continue
        whole = view_is_contiguous(e.local_shape, _lengths(tr))
        pieces.append((incoming, peer, transfer_bytes(tr, e), whole))
    return staging_bound(pieces, window_bytes or (EARLY_WINDOW_BYTES if release_early else WINDOW_BYTES))


def allocate_staging(need: tuple[int, int], device=None) -> tuple[object, object]:
    """Staging buffers (received, sent) of `need` bytes (plan_staging), written once so their pages are
    mapped before the pause; give them to `execute(..., staging=...)`."""
    import torch

    return tuple(torch.zeros(n, dtype=torch.uint8, device=device) for n in need)


def _at(e: ShardEntry, tr: Transfer) -> tuple[int, ...]:
    """Where the transfer's box starts in local piece `e`, along every dimension."""
    return tuple(lo - elo for (lo, _hi), (elo, _ehi) in zip(tr.box, e.box))


def _lengths(tr: Transfer) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in tr.box)


def _cut(t, at: tuple[int, ...], lengths: tuple[int, ...]):
    """The view of local tensor `t` holding `lengths` elements from `at` along every dimension."""
    for d, (a, n) in enumerate(zip(at, lengths)):
        if a or n != t.shape[d]:
            t = t.narrow(d, a, n)
    return t


@dataclass(frozen=True)
class LocalStep:
    """One transfer as this process does it: `op` "send" (the box of its old tensor `fqn` from `old_at`),
    "recv" (into its new tensor, from `new_at`: `nbytes`, contiguous when `whole`) or "copy" (both ends
    here), `lengths` along every dimension; `key` names it alike at both ends."""

    op: str
    fqn: str
    key: tuple
    src: int
    dst: int
    old_at: tuple[int, ...]
    new_at: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int
    whole: bool


@dataclass(frozen=True)
class LocalPlan:
    """What `execute` does on one process, worked out from the transfers and manifests alone (pure,
    `plan_local`), so that a runtime can do it before the pause: inside it, only views are cut and
    messages posted (planning it there was a fifth of the CPU of a pp4tp2dp3 -> pp4tp8dp1 transfer of
    a small model, where fixed costs dominate). `kept`: FQNs taken unchanged; `steps` in key order; `new`: (fqn, local shape, dtype)
    of every new piece; `old`: the FQNs of the old state."""

    kept: frozenset[str]
    steps: tuple[LocalStep, ...]
    new: tuple[tuple[str, tuple[int, ...], str], ...]
    old: tuple[str, ...]


def plan_local(transfers: Sequence[Transfer], old_rank: int | None, new_rank: int | None,
               old_manifest: Manifest | None, new_manifest: Manifest | None) -> LocalPlan:
    """This process's part of `transfers` (it is old rank `old_rank` and new rank `new_rank`). Pure."""
    from migrate.transfer import view_is_contiguous

    olds = old_manifest.by_fqn() if old_manifest is not None else {}
    news = new_manifest.by_fqn() if new_manifest is not None else {}
    kept = kept_pieces(transfers, old_rank, new_rank, old_manifest, new_manifest)
    steps = []
    for tr in sorted((t for t in transfers if t.src == old_rank and t.dst != new_rank
                      or t.dst == new_rank and t.fqn not in kept), key=_key):
        mine_old, mine_new = old_rank == tr.src, new_rank == tr.dst
        op = "copy" if mine_old and mine_new else "send" if mine_old else "recv"
        lengths = _lengths(tr)
        old_at = _at(olds[tr.fqn], tr) if mine_old else ()
        nbytes, whole, new_at = 0, True, ()
        if mine_new:
            e = news[tr.fqn]
            new_at, nbytes = _at(e, tr), transfer_bytes(tr, e)
            whole = view_is_contiguous(e.local_shape, lengths)
        steps.append(LocalStep(op, tr.fqn, _key(tr), tr.src, tr.dst, old_at, new_at, lengths, nbytes, whole))
    return LocalPlan(kept, tuple(steps), tuple((e.fqn, tuple(e.local_shape), e.dtype) for e in news.values()),
                     tuple(olds))


class Resharded(dict):
    """`execute`'s result: the new local tensors by FQN, and what the migration did.

    `units_verified`: transferred pieces whose digests matched at both ends (0 unless verify);
    `kept`: FQNs taken unchanged from the old state (the very tensors); `phases`: seconds of
    "transfer" and "verify"; `stats`: migrate.transfer.TransferStats; `built_ahead`: whether the
    transfer ran as prepared before the pause (prepare_transfer)."""

    def __init__(self, tensors: Mapping[str, object] | None = None) -> None:
        super().__init__(tensors or {})
        self.units_verified = 0
        self.kept: frozenset[str] = frozenset()
        self.phases: dict[str, float] = {}
        self.stats = None
        self.built_ahead = False


def _key(tr: Transfer) -> tuple:
    return (tr.fqn, tr.dst, tr.src, tr.box)


class PreparedTransfer:
    """This process's transfer built ahead of the pause (`prepare_transfer`): the transfer layer's
    messages cut, bound to their views and described, over the old tensors a runtime will move and the
    new tensors allocated ahead. `execute(..., prepared=...)` runs it when the old state it is given is
    still those very tensors (same memory, shape, strides, dtype; in-place optimizer steps keep them),
    and otherwise builds the transfer anew inside the pause."""

    def __init__(self, exchange, result: "Resharded", target, old: Mapping[str, tuple]) -> None:
        self.exchange, self.result, self.target = exchange, result, target
        self.old = dict(old)  # fqn -> (address, shape, strides, dtype) of the old tensor it cut views of
        self.old_state: MutableMapping[str, object] = {}  # the state `execute` runs it on (release early)

    def matches(self, old_state: Mapping[str, object]) -> bool:
        """Whether `old_state` holds the very tensors this transfer was cut from."""
        for fqn, fingerprint in self.old.items():
            t = old_state.get(fqn)
            if t is None or _fingerprint(t) != fingerprint:
                return False
        return True


def _fingerprint(t) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _build(lp: LocalPlan, old_rank: int | None, new_rank: int | None, old_state: Mapping[str, object],
           group, release_early: bool, window_bytes: int | None, targets: Mapping[str, object] | None,
           verify: bool, staging: tuple | None) -> PreparedTransfer:
    """The transfer layer's Exchange for `lp`, prepared (Exchange.prepare), peers named ("old", rank) and
    ("new", rank) (bound to ranks in `group` by `execute`), and the result it fills."""
    import torch

    from migrate.transfer import EARLY_WINDOW_BYTES, WINDOW_BYTES, Exchange

    shapes = {fqn: (shape, dtype) for fqn, shape, dtype in lp.new}
    result = Resharded(targets)

    def target(fqn: str):
        t = result.get(fqn)
        if t is None:
            shape, dtype = shapes[fqn]
            t = result[fqn] = torch.empty(shape, dtype=getattr(torch, dtype))
        return t

    used: dict[str, tuple] = {}

    def old(fqn: str):
        t = old_state[fqn]
        used[fqn] = _fingerprint(t)
        return t

    def release(fqn: str) -> None:
        prepared.old_state.pop(fqn, None)

    ex = Exchange(group, window_bytes or (EARLY_WINDOW_BYTES if release_early else WINDOW_BYTES),
                  release if release_early else None, digests=verify)
    for s in lp.steps:  # in key order; the layer orders them
        if s.op == "copy":
            ex.copy(_cut(target(s.fqn), s.new_at, s.lengths), _cut(old(s.fqn), s.old_at, s.lengths), s.fqn)
        elif s.op == "send":
            ex.send(("new", s.dst), s.key, _cut(old(s.fqn), s.old_at, s.lengths), s.fqn)
        else:
            ex.recv(("old", s.src), s.key, lambda s=s: _cut(target(s.fqn), s.new_at, s.lengths), s.nbytes,
                    s.whole)
    if release_early:  # a kept tensor leaves old_state too (it lives on in the result)
        for fqn in lp.old:
            ex.own(fqn)
    ex.prepare(staging, (("old", old_rank), ("new", new_rank)))
    prepared = PreparedTransfer(ex, result, target, used)  # its old_state is the one `execute` runs it on
    return prepared


def prepare_transfer(transfers: Sequence[Transfer], old_rank: int | None, new_rank: int | None,
                     old_state: Mapping[str, object], old_manifest: Manifest | None, new_manifest: Manifest | None,
                     release_early: bool = False, window_bytes: int | None = None,
                     targets: Mapping[str, object] | None = None, verify: bool = True, staging: tuple | None = None,
                     local: LocalPlan | None = None) -> PreparedTransfer:
    """This process's part of `transfers` built before the pause, over `old_state` as it is now (views of
    the tensors the pause will move, no copy): give it to `execute(..., prepared=...)` with the same
    arguments. Every view cut, every staged message bound to its staging region, every view a peer may
    read described: what is left for the pause is moving bytes."""
    lp = local if local is not None else plan_local(transfers, old_rank, new_rank, old_manifest, new_manifest)
    return _build(lp, old_rank, new_rank, old_state, None, release_early, window_bytes, targets, verify, staging)


def execute(transfers: Sequence[Transfer], old_rank: int | None, new_rank: int | None,
            old_state: MutableMapping[str, object], old_manifest: Manifest | None, new_manifest: Manifest | None,
            proc_of_old: Sequence[int], proc_of_new: Sequence[int], group=None, release_early: bool = False,
            window_bytes: int | None = None, on_window=None, targets: Mapping[str, object] | None = None,
            verify: bool = True, staging: tuple | None = None, local: LocalPlan | None = None,
            prepared: PreparedTransfer | None = None) -> Resharded:
    """Run this process's part of `transfers` on the shared transfer layer (migrate.transfer);
    returns its new local tensors by FQN (a `Resharded` dict).

    `old_state`: this process's local tensors (old rank `old_rank`), `proc_of_old[r]`/`proc_of_new[r]`:
    the rank in `group` (the process group of old and new processes) of old/new rank r. Every
    process of `group` calls it with the same transfers (or with those it sends or receives: it skips
    the others), so sends and receives pair up. Safe by
    default: `old_state` is not written, and a failure (migrate.transfer.TransferError, or
    MigrationMismatch on every process when `verify` finds a piece that differs) leaves it whole.
    Pieces held unchanged (`kept_pieces`) are the very old tensors in the result, unless `targets`
    names them. `release_early`: each old tensor is dropped from `old_state` once its receivers
    confirmed their copies, and new tensors not in `targets` are allocated only when their window comes
    (lower peak memory; a failure then leaves some old tensors gone, covered by verified new copies).
    `targets`: new tensors by FQN allocated (and written) ahead, before the pause (plan_targets,
    allocate_targets): receiving into memory already mapped is several times faster on CPU. `staging`:
    the transfer layer's buffers allocated ahead the same way (plan_staging, allocate_staging). `local`:
    this process's part of the transfers worked out ahead (plan_local of the same arguments); without
    it, execute works it out itself. `prepared`: the whole transfer built ahead (prepare_transfer with
    the same arguments), used when `old_state` still holds the tensors it was built over."""
    import time

    t0 = time.perf_counter()
    lp = local if local is not None else plan_local(transfers, old_rank, new_rank, old_manifest, new_manifest)
    ahead = prepared is not None and prepared.matches(old_state)
    if not ahead:
        prepared = _build(lp, old_rank, new_rank, old_state, group, release_early, window_bytes, targets, verify,
                          staging)
    ex, result = prepared.exchange, prepared.result
    result.built_ahead = ahead
    ex.group = group
    prepared.old_state = old_state
    kept = lp.kept - set(result)
    for fqn in kept:
        result[fqn] = old_state[fqn]
    result.kept = kept
    ranks = {("old", r): p for r, p in enumerate(proc_of_old)} | {("new", r): p for r, p in enumerate(proc_of_new)}
    result.stats = ex.run(on_window, staging, ranks)
    for fqn, _shape, _dtype in lp.new:  # pieces that no transfer fills (an empty shard) still exist
        prepared.target(fqn)
    t1 = time.perf_counter()
    # the senders' digests are taken while their bytes are in flight, staged messages' as they land
    # (part of the transfer); direct messages' over the new tensors after the last window, then
    # compared: "verify"
    result.phases["transfer"] = t1 - t0 - result.stats.final_digest_s
    if verify:
        result.units_verified = _verify(ex, group)
        result.phases["verify"] = time.perf_counter() - t1 + result.stats.final_digest_s
    return result


def _verify(ex, group) -> int:
    """Compare every message this process received with its sender's digest of what it sent (the bytes
    it handed over, cut from its old tensors by the sender's manifest; Exchange.compare); every process
    of `group` learns whether any piece anywhere differed (one all-reduce) and raises MigrationMismatch
    if so. Returns the pieces verified here."""
    import torch
    import torch.distributed as dist

    from migrate.transfer import TransferError

    bad, checked = ex.compare()
    flag = torch.tensor([len(bad)], dtype=torch.int64)
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
    except Exception as exc:  # a dead peer shows up here as a gloo error
        raise TransferError(f"{type(exc).__name__}: {exc}") from exc
    if int(flag.item()):
        here = ""
        if bad:  # a transfer key: (fqn, dst, src, box)
            fqn, _dst, src, box = bad[0]
            here = f"; here {fqn} [{', '.join(f'{lo}:{hi}' for lo, hi in box)}] from old rank {src}"
        raise MigrationMismatch(f"{int(flag.item())} transferred pieces differ from what was sent{here}; "
                                "nothing adopted")
    return checked


def transfer_bytes(tr: Transfer, e: ShardEntry) -> int:
    """Bytes transfer `tr` moves into new piece `e`."""
    return tr.numel * DTYPE_BYTES[e.dtype]
