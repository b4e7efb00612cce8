"""Move any model's training state from one layout to another, between running processes, by manifest.

The reference GPT has its own planner and executor (migrate.plan, migrate.executor); this is the
path for every other model, described only by per-rank manifests (migrate.manifest): for each
piece a new rank needs, `plan_transfers` picks old holders (the same process first, then the
least loaded one) and the exact index range each sends; `execute` runs the transfers between
processes in one batch of point-to-point sends and receives, copying locally what a process
already holds. Planning is pure; only `execute` touches torch.distributed.

A tensor is cut along at most one dimension on each side (DTensor Shard(d)/Replicate); when both
sides cut it, they must cut the same dimension (a TP style fixes it per parameter).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from migrate.manifest import DTYPE_BYTES, Manifest, ManifestError, ShardEntry


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


def _piece(t, e: ShardEntry, tr: Transfer):
    """The view of local tensor `t` (piece `e`) holding the transfer's rows."""
    if tr.dim is None:
        return t
    base = e.range[0] if e.dim is not None else 0
    return t.narrow(tr.dim, tr.lo - base, tr.hi - tr.lo)


def execute(transfers: Sequence[Transfer], old_rank: int | None, new_rank: int | None,
            old_state: MutableMapping[str, object], old_manifest: Manifest | None, new_manifest: Manifest | None,
            proc_of_old: Sequence[int], proc_of_new: Sequence[int], group=None, release_early: bool = False,
            window_bytes: int | None = None, on_window=None, targets: Mapping[str, object] | None = None
            ) -> dict[str, object]:
    """Run this process's part of `transfers` on the shared transfer layer (migrate.transfer);
    returns its new local tensors by FQN.

    `old_state`: this process's local tensors (old rank `old_rank`), `proc_of_old[r]`/`proc_of_new[r]`:
    the rank in `group` (the process group of old and new processes) of old/new rank r. Every
    process calls it with the same transfers, so sends and receives pair up. Safe by default:
    `old_state` is not touched, and a failure (migrate.transfer.TransferError) leaves it whole.
    `release_early`: each old tensor is dropped from `old_state` once its receivers confirmed their
    copies, and new tensors are allocated only when their window comes (lower peak memory).
    `targets`: new tensors by FQN allocated (and written) ahead, before the pause: receiving into
    memory already mapped is several times faster on CPU than into fresh memory."""
    import torch

    from migrate.transfer import EARLY_WINDOW_BYTES, WINDOW_BYTES, Exchange, narrow_is_contiguous

    olds = old_manifest.by_fqn() if old_manifest is not None else {}
    news = new_manifest.by_fqn() if new_manifest is not None else {}
    dtypes = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
              "float16": torch.float16, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
              "int8": torch.int8, "bool": torch.bool}
    result: dict[str, object] = dict(targets or {})

    def target(fqn: str):
        t = result.get(fqn)
        if t is None:
            t = result[fqn] = torch.empty(news[fqn].local_shape, dtype=dtypes[news[fqn].dtype])
        return t

    def release(fqn: str) -> None:
        old_state.pop(fqn, None)

    ex = Exchange(group, window_bytes or (EARLY_WINDOW_BYTES if release_early else WINDOW_BYTES),
                  release if release_early else None)
    for tr in [t for t in transfers if t.src == old_rank or t.dst == new_rank]:  # the layer orders them
        src_proc, dst_proc = proc_of_old[tr.src], proc_of_new[tr.dst]
        key = (tr.fqn, tr.dst, tr.src, -1 if tr.dim is None else tr.dim, tr.lo, tr.hi)
        mine_old, mine_new = old_rank == tr.src, new_rank == tr.dst
        if mine_old and mine_new:
            ex.copy(_piece(target(tr.fqn), news[tr.fqn], tr), _piece(old_state[tr.fqn], olds[tr.fqn], tr), tr.fqn)
        elif mine_old:
            ex.send(dst_proc, key, _piece(old_state[tr.fqn], olds[tr.fqn], tr), tr.fqn)
        elif mine_new:
            e = news[tr.fqn]
            whole = tr.dim is None or narrow_is_contiguous(e.local_shape, tr.dim, tr.hi - tr.lo)
            ex.recv(src_proc, key, lambda tr=tr: _piece(target(tr.fqn), news[tr.fqn], tr), transfer_bytes(tr, e), whole)
    if release_early:
        for fqn in olds:
            ex.own(fqn)
    ex.run(on_window)
    for fqn in news:  # pieces that no transfer fills (an empty shard) still exist
        target(fqn)
    return result


def transfer_bytes(tr: Transfer, e: ShardEntry) -> int:
    """Bytes transfer `tr` moves into new piece `e`."""
    if tr.dim is None:
        return e.nbytes
    return math.prod(tr.hi - tr.lo if d == tr.dim else s for d, s in enumerate(e.local_shape)) * DTYPE_BYTES[e.dtype]
