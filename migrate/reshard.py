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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from migrate.manifest import Manifest, ManifestError, ShardEntry


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
            old_state: Mapping[str, object], old_manifest: Manifest | None, new_manifest: Manifest | None,
            proc_of_old: Sequence[int], proc_of_new: Sequence[int], group=None) -> dict[str, object]:
    """Run this process's part of `transfers`; returns its new local tensors by FQN.

    `old_state`: this process's local tensors (old rank `old_rank`), `proc_of_old[r]`/`proc_of_new[r]`:
    the rank in `group` (the process group of old and new processes) of old/new rank r. Every
    process calls it with the same transfers, so sends and receives pair up in one batch."""
    import torch
    import torch.distributed as dist

    olds = old_manifest.by_fqn() if old_manifest is not None else {}
    news = new_manifest.by_fqn() if new_manifest is not None else {}
    dtypes = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
              "float16": torch.float16, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
              "int8": torch.int8, "bool": torch.bool}
    result = {f: torch.empty(e.local_shape, dtype=dtypes[e.dtype]) for f, e in news.items()}
    me = dist.get_rank(group) if group is not None or dist.is_initialized() else 0
    ops, recvs = [], []
    for tr in sorted(transfers):
        src_proc, dst_proc = proc_of_old[tr.src], proc_of_new[tr.dst]
        if src_proc == me and dst_proc == me and old_rank == tr.src and new_rank == tr.dst:
            _piece(result[tr.fqn], news[tr.fqn], tr).copy_(_piece(old_state[tr.fqn], olds[tr.fqn], tr))
        elif src_proc == me and old_rank == tr.src:
            buf = _piece(old_state[tr.fqn], olds[tr.fqn], tr).contiguous()
            ops.append(dist.P2POp(dist.isend, buf, _global(dst_proc, group), group))
        elif dst_proc == me and new_rank == tr.dst:
            view = _piece(result[tr.fqn], news[tr.fqn], tr)
            buf = torch.empty(view.shape, dtype=view.dtype)
            ops.append(dist.P2POp(dist.irecv, buf, _global(src_proc, group), group))
            recvs.append((view, buf))
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    for view, buf in recvs:
        view.copy_(buf)
    return result


def _global(rank: int, group) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)
