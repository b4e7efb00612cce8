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

A tensor is cut along at most one dimension on each side (DTensor Shard(d)/Replicate); when both
sides cut it, they must cut the same dimension (a TP style fixes it per parameter).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from migrate.manifest import DTYPE_BYTES, Manifest, ManifestError, ShardEntry


class MigrationMismatch(RuntimeError):
    """A transferred piece arrived different from what was sent (digests differ): nothing is adopted.
    (A dead peer raises migrate.transfer.TransferError instead; planning here stays free of torch.)"""


@dataclass(frozen=True, order=True)
class Transfer:
    """Rows [lo, hi) along `dim` (None: the whole tensor) of `fqn`, from old rank `src` to new rank `dst`."""

    fqn: str
    dst: int
    src: int
    dim: int | None
    lo: int
    hi: int


def _cut_dim(a: ShardEntry, b: ShardEntry) -> int | None:
    if a.dim is not None and b.dim is not None and a.dim != b.dim:
        raise ManifestError(f"{a.fqn}: cut along dim {a.dim} in one layout and dim {b.dim} in the other")
    return a.dim if a.dim is not None else b.dim


def _span(e: ShardEntry, dim: int | None) -> tuple[int, int]:
    """[lo, hi) of `e` along `dim` (its whole extent when it is not cut)."""
    if dim is None:
        return 0, 1
    return e.range if e.dim is not None else (0, e.shape[dim])


def plan_transfers(old: Sequence[Manifest], new: Sequence[Manifest], same: Mapping[int, int]) -> list[Transfer]:
    """Who sends what: `old[r]` is what old rank r holds, `new[r]` what new rank r needs, `same[new rank]`
    the old rank on the same process (if any). Raises ManifestError when some piece has no holder."""
    holders: dict[str, list[tuple[int, ShardEntry]]] = {}
    for r, m in enumerate(old):
        for e in m.entries:
            holders.setdefault(e.fqn, []).append((r, e))
    load = [0] * len(old)
    out: list[Transfer] = []
    for dst, m in enumerate(new):
        for need in m.entries:
            have = holders.get(need.fqn)
            if not have:
                raise ManifestError(f"{need.fqn}: no process holds it in the old layout")
            dim = _cut_dim(need, have[0][1])
            lo, hi = _span(need, dim)
            pos = lo
            while pos < hi:
                # holders covering `pos`; the same process first, then the least loaded
                cover = [(r, e) for r, e in have if _span(e, dim)[0] <= pos < _span(e, dim)[1]]
                if not cover:
                    raise ManifestError(f"{need.fqn}: rows from {pos} are held by no old rank")
                r, e = min(cover, key=lambda x: (x[0] != same.get(dst), load[x[0]], x[0]))
                end = min(hi, _span(e, dim)[1])
                out.append(Transfer(need.fqn, dst, r, dim, pos, end))
                if r != same.get(dst):
                    load[r] += (end - pos) * need.row_bytes if dim is not None else need.nbytes
                pos = end
    return out


def _box(e: ShardEntry) -> tuple[tuple[int, int], ...]:
    """The elements piece `e` holds: its [lo, hi) along every dimension."""
    return tuple(e.range if d == e.dim else (0, n) for d, n in enumerate(e.shape))


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
                     and olds[e.fqn].dtype == e.dtype and _box(olds[e.fqn]) == _box(e))


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
    from migrate.transfer import EARLY_WINDOW_BYTES, WINDOW_BYTES, narrow_is_contiguous, staging_bound

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
        whole = tr.dim is None or narrow_is_contiguous(e.local_shape, tr.dim, tr.hi - tr.lo)
        pieces.append((incoming, peer, transfer_bytes(tr, e), whole))
    return staging_bound(pieces, window_bytes or (EARLY_WINDOW_BYTES if release_early else WINDOW_BYTES))


def allocate_staging(need: tuple[int, int], device=None) -> tuple[object, object]:
    """Staging buffers (received, sent) of `need` bytes (plan_staging), written once so their pages are
    mapped before the pause; give them to `execute(..., staging=...)`."""
    import torch

    return tuple(torch.zeros(n, dtype=torch.uint8, device=device) for n in need)


def _at(e: ShardEntry, tr: Transfer) -> int:
    """Where the transfer's rows start in local piece `e` (along tr.dim)."""
    return tr.lo - (e.range[0] if e.dim is not None else 0) if tr.dim is not None else 0


def _cut(t, dim: int | None, at: int, length: int):
    """The view of local tensor `t` holding `length` rows from `at` along `dim` (None: all of it)."""
    return t if dim is None else t.narrow(dim, at, length)


@dataclass(frozen=True)
class LocalStep:
    """One transfer as this process does it: `op` "send" (rows of its old tensor `fqn`, from `old_at`),
    "recv" (into its new tensor, from `new_at`: `nbytes`, contiguous when `whole`) or "copy" (both ends
    here); `key` names it alike at both ends."""

    op: str
    fqn: str
    key: tuple
    src: int
    dst: int
    dim: int | None
    old_at: int
    new_at: int
    length: int
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
    from migrate.transfer import narrow_is_contiguous

    olds = old_manifest.by_fqn() if old_manifest is not None else {}
    news = new_manifest.by_fqn() if new_manifest is not None else {}
    kept = kept_pieces(transfers, old_rank, new_rank, old_manifest, new_manifest)
    steps = []
    for tr in sorted((t for t in transfers if t.src == old_rank and t.dst != new_rank
                      or t.dst == new_rank and t.fqn not in kept), key=_key):
        mine_old, mine_new = old_rank == tr.src, new_rank == tr.dst
        op = "copy" if mine_old and mine_new else "send" if mine_old else "recv"
        length = tr.hi - tr.lo
        old_at = _at(olds[tr.fqn], tr) if mine_old else 0
        nbytes, whole, new_at = 0, True, 0
        if mine_new:
            e = news[tr.fqn]
            new_at, nbytes = _at(e, tr), transfer_bytes(tr, e)
            whole = tr.dim is None or narrow_is_contiguous(e.local_shape, tr.dim, length)
        steps.append(LocalStep(op, tr.fqn, _key(tr), tr.src, tr.dst, tr.dim, old_at, new_at, length, nbytes, whole))
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
    return (tr.fqn, tr.dst, tr.src, -1 if tr.dim is None else tr.dim, tr.lo, tr.hi)


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
            ex.copy(_cut(target(s.fqn), s.dim, s.new_at, s.length), _cut(old(s.fqn), s.dim, s.old_at, s.length), s.fqn)
        elif s.op == "send":
            ex.send(("new", s.dst), s.key, _cut(old(s.fqn), s.dim, s.old_at, s.length), s.fqn)
        else:
            ex.recv(("old", s.src), s.key, lambda s=s: _cut(target(s.fqn), s.dim, s.new_at, s.length), s.nbytes,
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
        if bad:  # a transfer key: (fqn, dst, src, dim, lo, hi)
            fqn, _dst, src, _dim, lo, hi = bad[0]
            here = f"; here {fqn} rows {lo}:{hi} from old rank {src}"
        raise MigrationMismatch(f"{int(flag.item())} transferred pieces differ from what was sent{here}; "
                                "nothing adopted")
    return checked


def transfer_bytes(tr: Transfer, e: ShardEntry) -> int:
    """Bytes transfer `tr` moves into new piece `e`."""
    if tr.dim is None:
        return e.nbytes
    return math.prod(tr.hi - tr.lo if d == tr.dim else s for d, s in enumerate(e.local_shape)) * DTYPE_BYTES[e.dtype]
