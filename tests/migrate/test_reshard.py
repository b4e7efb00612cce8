"""migrate.reshard: any model's state moved between layouts by manifest. The pure transfer plan is
checked to cover every needed element exactly once (brute force); the executor moves real tensors
between 3 real processes and every new piece is compared with the full tensors it was cut from."""
from __future__ import annotations

import os

import pytest
import torch

from migrate.manifest import Manifest, ManifestError, ShardEntry, meta_module, plan_manifest
from migrate.reshard import plan_transfers
from tests.migrate.test_manifest import TP_PLAN, Mixer


def layout(tp: int, *size: int, fsdp: int = 1) -> list[Manifest]:
    """Manifests of the ranks of the Mixer (of `size` (d, hidden) if given) on TP x FSDP (rank f * tp + t)."""
    return [plan_manifest(meta_module(Mixer, *size), TP_PLAN, tp, r % tp, fsdp=fsdp, fsdp_rank=r // tp)
            for r in range(tp * fsdp)]


def full_tensors(*size: int) -> dict[str, torch.Tensor]:
    """Every tensor of the state, whole, from a seed per name (the oracle)."""
    out = {}
    for e in layout(1, *size)[0].entries:
        g = torch.Generator().manual_seed(sum(map(ord, e.fqn)))
        out[e.fqn] = torch.randn(e.shape, generator=g)
    return out


def cut(t: torch.Tensor, e: ShardEntry) -> torch.Tensor:
    """The piece `e` of `t` by torch.chunk, cut after cut (the oracle, not the manifest's box)."""
    for dim, index, count in e.cuts:
        t = torch.chunk(t, count, dim=dim)[index]
    return t


def box_of(t: torch.Tensor, box) -> torch.Tensor:
    for d, (lo, hi) in enumerate(box):
        t = t.narrow(d, lo, hi - lo)
    return t


@pytest.mark.parametrize("a,b,same", [(2, 1, {0: 1}), (1, 2, {}), (2, 2, {0: 1, 1: 0}), (1, 3, {2: 0}),
                                      ((2, 1), (2, 2), {0: 0, 1: 1}), ((2, 2), (2, 1), {1: 3}),
                                      ((1, 2), (2, 2), {3: 1}), ((2, 2), (1, 3), {}), ((1, 4), (2, 2), {0: 0})])
def test_transfers_cover_every_needed_element_once(a, b, same: dict[int, int]) -> None:
    """(tp, fsdp) pairs: FSDP2's cut of a TP shard (a row-parallel weight by rows and columns) against TP
    alone, FSDP alone (1, f) and other FSDP x TP: transfers are boxes."""
    (ta, fa), (tb, fb) = (a if isinstance(a, tuple) else (a, 1)), (b if isinstance(b, tuple) else (b, 1))
    old, new = layout(ta, 8, 10, fsdp=fa), layout(tb, 8, 10, fsdp=fb)
    trs = plan_transfers(old, new, same)
    for dst, m in enumerate(new):
        for e in m.entries:
            count = torch.zeros(e.shape)  # brute force: every element counted where it lands
            for tr in (t for t in trs if t.fqn == e.fqn and t.dst == dst):
                mask = torch.zeros(e.shape, dtype=torch.bool)
                cut(mask, old[tr.src].by_fqn()[e.fqn]).fill_(True)
                assert box_of(mask, tr.box).all()  # the sender holds those elements
                box_of(count, tr.box).add_(1)
            assert torch.equal(cut(count, e), torch.ones(e.local_shape)), (e.fqn, dst)
            assert count.sum() == cut(count, e).sum()  # nothing outside the piece
    local = [t for t in trs if same.get(t.dst) == t.src]
    if same:  # what a process already holds is never sent
        assert local and all(t.src == same[t.dst] for t in trs if same.get(t.dst) is not None
                             and old[same[t.dst]].by_fqn()[t.fqn].dim is None)


@pytest.mark.parametrize("a,b", [(2, 1), (1, 2), (2, 3), (3, 1)])
def test_bytes_of_a_transfer_are_the_elements_it_moves(a: int, b: int) -> None:
    from migrate.reshard import transfer_bytes

    new = layout(b)
    for tr in plan_transfers(layout(a), new, {}):
        e = new[tr.dst].by_fqn()[tr.fqn]
        mask = torch.zeros(e.shape, dtype=torch.bool)  # brute force: mark the moved elements
        box_of(mask, tr.box).fill_(True)
        mask = cut(mask, e)
        assert transfer_bytes(tr, e) == int(mask.sum()) * 4, tr


@pytest.mark.parametrize("a,b,same", [(2, 1, {0: 1}), (1, 2, {}), (2, 2, {0: 1, 1: 0}), (1, 3, {2: 0}), (2, 2, {0: 0})])
def test_local_plan_cuts_the_rows_each_transfer_names(a: int, b: int, same: dict[int, int]) -> None:
    """plan_local, worked out ahead of the pause: every process sends, receives or copies exactly its
    transfers, and its offsets cut from its local tensors the rows the transfer names in the whole
    tensor (the oracle: torch.chunk of the full tensors, not the manifests' ranges)."""
    from migrate.reshard import _cut, plan_local

    old, new = layout(a, 4, 6), layout(b, 4, 6)
    full = full_tensors(4, 6)
    trs = plan_transfers(old, new, same)
    procs = [(o, n) for n, o in same.items()] + [(o, None) for o in range(a) if o not in same.values()] + \
        [(None, n) for n in range(b) if n not in same]
    for o, n in procs:
        om, nm = (old[o] if o is not None else None), (new[n] if n is not None else None)
        lp = plan_local(trs, o, n, om, nm)
        want = {("copy" if t.src == o and t.dst == n else "send" if t.src == o else "recv", t.fqn, t.dst, t.src,
                 t.box) for t in trs
                if (t.src == o or t.dst == n) and not (t.dst == n and t.fqn in lp.kept)}
        assert {(s.op, *s.key) for s in lp.steps} == want
        assert lp.kept <= {e.fqn for e in nm.entries} if nm else not lp.kept
        for s in lp.steps:
            rows = box_of(full[s.fqn], s.key[3])
            if s.op in ("send", "copy"):
                assert torch.equal(_cut(cut(full[s.fqn], om.by_fqn()[s.fqn]), s.old_at, s.lengths), rows)
            if s.op in ("recv", "copy"):
                view = _cut(cut(full[s.fqn], nm.by_fqn()[s.fqn]).contiguous(), s.new_at, s.lengths)
                assert torch.equal(view, rows)
                assert (s.nbytes, s.whole) == (rows.numel() * rows.element_size(), view.is_contiguous())


def test_a_piece_nobody_holds_is_refused() -> None:
    with pytest.raises(ManifestError, match="no process holds"):
        plan_transfers([Manifest(())], layout(1), {})


def _run(proc: int, port: int, q) -> None:
    import torch.distributed as dist

    from migrate.reshard import execute

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=proc, world_size=3)
    full = full_tensors()
    ok = []
    # TP2 on processes 0,1 -> TP1 DP2 on processes 1,2 -> TP2 on processes 2,0
    steps = [(2, [0, 1]), (1, [1, 2]), (2, [2, 0])]
    state = {}
    (tp, procs) = steps[0]
    if proc in procs:
        m = layout(tp)[procs.index(proc)]
        state = {e.fqn: cut(full[e.fqn], e).clone() for e in m.entries}
    for (tp_a, procs_a), (tp_b, procs_b) in zip(steps, steps[1:]):
        old_l, new_l = layout(tp_a), layout(tp_b)
        # DP replicas: new rank r of a TP1 DP2 layout is (tp 0): both hold manifest 0
        old_ms = [old_l[i % tp_a] for i in range(len(procs_a))]
        new_ms = [new_l[i % tp_b] for i in range(len(procs_b))]
        same = {r: procs_a.index(p) for r, p in enumerate(procs_b) if p in procs_a}
        trs = plan_transfers(old_ms, new_ms, same)
        o = procs_a.index(proc) if proc in procs_a else None
        n = procs_b.index(proc) if proc in procs_b else None
        state = execute(trs, o, n, state, old_ms[o] if o is not None else None,
                        new_ms[n] if n is not None else None, procs_a, procs_b)
        if n is not None:
            ok.append(all(torch.equal(state[e.fqn], cut(full[e.fqn], e)) for e in new_ms[n].entries)
                      and set(state) == {e.fqn for e in new_ms[n].entries})
    q.put((proc, ok))
    dist.barrier()
    dist.destroy_process_group()


def test_state_moves_bit_exact_between_real_processes_tp2_to_dp2_to_tp2() -> None:
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_run, 3)
    assert got == {0: [True], 1: [True], 2: [True, True]}
