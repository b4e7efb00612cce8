"""migrate.reshard around the pause: what to allocate ahead (pure, checked by element masks), receiving
into those buffers, unchanged pieces kept as the very old tensors, digests that catch a corrupted
piece on every process with the old state whole, and release-early really freeing old memory during
the transfer (a joiner receiving into tensors allocated ahead all the same). Real processes (gloo); the
oracle is the full tensors each piece is cut from."""
from __future__ import annotations

import weakref

import pytest
import torch

from migrate.reshard import plan_targets, plan_transfers
from tests.migrate.test_reshard import cut
from tests.migrate.test_transfer import _init, full_tensors, layout


def elements(e) -> set[int]:
    """Indices (into the whole tensor) of the elements piece `e` holds, by brute force."""
    idx = torch.arange(max(1, int(torch.tensor(e.shape).prod())) if e.shape else 1).view(e.shape)
    return set(cut(idx, e).reshape(-1).tolist())


@pytest.mark.parametrize("a,b,same", [(2, 2, {0: 0, 1: 1}), (2, 1, {0: 1}), (1, 2, {1: 0}), (2, 2, {0: 1}),
                                      (1, 1, {0: 0})])
def test_targets_are_every_new_piece_but_those_held_unchanged(a: int, b: int, same: dict[int, int]) -> None:
    old, new = layout(a), layout(b)
    trs = plan_transfers(old, new, same)
    for dst, m in enumerate(new):
        o = same.get(dst)
        held = {e.fqn: elements(e) for e in old[o].entries} if o is not None else {}
        unchanged = {e.fqn for e in m.entries if held.get(e.fqn) == elements(e)}
        got = plan_targets(trs, o, dst, old[o] if o is not None else None, m)
        assert {e.fqn for e in got} == {e.fqn for e in m.entries} - unchanged, (a, b, same, dst)
        assert all(e in m.entries for e in got)
    assert plan_targets(trs, 0, None, old[0], None) == ()


def step(proc: int, a: tuple[int, list[int]], b: tuple[int, list[int]], state: dict, ahead: bool = False,
         staged: bool = False, prepare=None, **kw):
    """One layout change (tp, processes) a -> b of this process's `state`; (new manifest or None, new
    state, the buffers allocated ahead). staged: the staging planned and allocated ahead too (its bytes
    in the new state's `staging_planned`). prepare: the transfer built ahead (prepare_transfer), then
    `prepare(state)` called before the pause (the old layout's last steps)."""
    from migrate.reshard import allocate_staging, allocate_targets, execute, plan_staging

    (tp_a, procs_a), (tp_b, procs_b) = a, b
    old_ms = [layout(tp_a)[i % tp_a] for i in range(len(procs_a))]
    new_ms = [layout(tp_b)[i % tp_b] for i in range(len(procs_b))]
    same = {r: procs_a.index(p) for r, p in enumerate(procs_b) if p in procs_a}
    o = procs_a.index(proc) if proc in procs_a else None
    n = procs_b.index(proc) if proc in procs_b else None
    om, nm = (old_ms[o] if o is not None else None), (new_ms[n] if n is not None else None)
    trs = plan_transfers(old_ms, new_ms, same)
    early = kw.get("release_early", False)
    targets = allocate_targets(plan_targets(trs, o, n, om, nm, early)) if ahead else {}
    need = plan_staging(trs, o, n, om, nm, early, kw.get("window_bytes")) if staged else None
    staging = allocate_staging(need) if need else None
    if prepare is not None:  # the transfer built ahead over the state of now, then the state changes
        from migrate.reshard import prepare_transfer

        kw["prepared"] = prepare_transfer(trs, o, n, state, om, nm, early, kw.get("window_bytes"),
                                          targets or None, staging=staging)
        prepare(state)
    new = execute(trs, o, n, state, om, nm, procs_a, procs_b, targets=targets or None, staging=staging, **kw)
    new.staging_planned = sum(need) if need else 0
    return nm, new, targets


def start(proc: int, tp: int, procs: list[int], full: dict) -> dict:
    m = layout(tp)[procs.index(proc)] if proc in procs else None
    return {e.fqn: cut(full[e.fqn], e).clone() for e in m.entries} if m else {}


def holds_exactly(state: dict, m, full: dict) -> bool:
    return set(state) == {e.fqn for e in m.entries} and all(torch.equal(state[e.fqn], cut(full[e.fqn], e))
                                                            for e in m.entries)


def _targets(proc: int, port: int, q) -> None:
    import torch.distributed as dist

    _init(proc, port)
    full = full_tensors()
    # TP2 on 0,1 -> TP2 on 0,2 (process 0 keeps its shard) -> TP1 DP2 on 1,2 (2 keeps its whole pieces)
    steps = [(2, [0, 1]), (2, [0, 2]), (1, [1, 2])]
    state = start(proc, *steps[0], full)
    out = []
    for a, b in zip(steps, steps[1:]):
        m, new, targets = step(proc, a, b, state, ahead=True)
        if m is None:
            out.append(None)
        else:
            kept = sorted(f for f in new if f in state and new[f] is state[f])
            out.append((holds_exactly(new, m, full), kept == sorted(new.kept), len(kept),
                        all(new[f] is t for f, t in targets.items()), new.units_verified >= len(targets)))
        state = dict(new)
    q.put((proc, out))
    dist.barrier()
    dist.destroy_process_group()


def test_new_state_lands_in_buffers_allocated_ahead_and_unchanged_pieces_are_kept() -> None:
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_targets, 3)
    whole = sum(e.dim is None for e in layout(2)[0].entries)  # norm weight/bias, down.bias and their moments
    n = len(layout(2)[0].entries)
    assert got == {0: [(True, True, n, True, True), None], 1: [None, (True, True, 0, True, True)],
                   2: [(True, True, 0, True, True), (True, True, whole, True, True)]}


def _corrupted(proc: int, port: int, q) -> None:
    """Process 2's data messages land with one byte flipped (after its sender took its digests): staged
    ones (packed, strided) and direct ones, into the buffers allocated ahead."""
    import torch.distributed as dist

    from migrate.reshard import MigrationMismatch

    _init(proc, port)
    full = full_tensors()
    a, b = (2, [0, 1]), (1, [1, 2])
    state = start(proc, *a, full)
    if proc == 2:
        irecv = dist.irecv

        class Flipped:
            def __init__(self, work, t) -> None:
                self.work, self.t = work, t

            def wait(self) -> bool:
                out = self.work.wait()
                self.t[3] ^= 0x10
                return out

            def is_completed(self) -> bool:
                return self.work.is_completed()

        def flipped(t, *args, **kw):
            work = irecv(t, *args, **kw)
            if kw.get("tag", 0) == 0 and t.dtype == torch.uint8 and t.numel() > 8:  # data, not a digest vector
                return Flipped(work, t)
            return work

        dist.irecv = flipped
    try:
        step(proc, a, b, state, ahead=True, window_bytes=1)
        verdict = "adopted"
    except MigrationMismatch as exc:
        verdict = "refused" if "\n" not in str(exc) else "refused, several lines"
    intact = proc == 2 or holds_exactly(state, layout(2)[proc], full)
    q.put((proc, (verdict, intact)))
    dist.barrier()
    dist.destroy_process_group()


def test_a_corrupted_piece_is_refused_on_every_process_and_the_old_state_stays() -> None:
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_corrupted, 3)
    assert got == {0: ("refused", True), 1: ("refused", True), 2: ("refused", True)}


def _frees(proc: int, port: int, q) -> None:
    import torch.distributed as dist

    _init(proc, port)
    full = full_tensors()
    a, b = (2, [0, 1]), (2, [2, 0])  # 0 keeps only its whole pieces; 1 sends all and leaves
    state = start(proc, *a, full)
    new_m = layout(2)[b[1].index(proc)] if proc in b[1] else None
    same = {e.fqn for e in new_m.entries if e.fqn in state and elements(e) == elements(layout(2)[0].by_fqn()[e.fqn])} \
        if new_m is not None and proc == 0 else set()
    refs = {f: weakref.ref(t) for f, t in state.items() if f not in same}
    leaks: set[str] = set()
    freed_during = []

    def check(window: int) -> None:  # an old tensor gone from the state must be gone from memory
        leaks.update(f for f, r in refs.items() if f not in state and r() is not None)
        freed_during.append(sum(r() is None for r in refs.values()))

    m, new, _ = step(proc, a, b, state, release_early=True, window_bytes=8 << 10, on_window=check)
    del new
    q.put((proc, (sorted(leaks), max(freed_during, default=0) > 0, len(state))))
    dist.barrier()
    dist.destroy_process_group()


def test_release_early_frees_old_tensors_during_the_transfer() -> None:
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_frees, 3)
    assert [(leaks, left) for leaks, _freed, left in got.values()] == [([], 0)] * 3  # no leak, nothing old left
    assert any(freed for _leaks, freed, _left in got.values())  # the check ran while tensors were being released


def _joiner_ahead(proc: int, port: int, q) -> None:
    import torch.distributed as dist

    _init(proc, port)
    full = full_tensors()
    a, b = (2, [0, 1]), (1, [0, 2])  # TP2 -> two whole replicas: 0 receives the half it lacks, 1 leaves, 2 joins
    state = start(proc, *a, full)
    # every process asks, as the runtime does: with release early only the joiner (no old state) allocates ahead
    m, new, targets = step(proc, a, b, state, ahead=True, release_early=True, window_bytes=8 << 10)
    landed = bool(targets) and all(new[f] is t for f, t in targets.items())
    q.put((proc, (m is None or holds_exactly(new, m, full), landed, len(state))))
    dist.barrier()
    dist.destroy_process_group()


def test_release_early_joiner_receives_into_tensors_allocated_ahead() -> None:
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_joiner_ahead, 3)
    assert got == {0: (True, False, 0), 1: (True, False, 0), 2: (True, True, 0)}


def _wire(proc: int, port: int, q) -> None:
    """Process 0's data messages arrive with one byte flipped (the wire corrupts them after the sender
    took its digests from the bytes it hands over)."""
    import torch.distributed as dist

    from migrate.reshard import MigrationMismatch

    _init(proc, port)
    full = full_tensors()
    a, b = (2, [0, 1]), (1, [1, 2])
    state = start(proc, *a, full)
    if proc == 0:
        isend = dist.isend

        def flipped(t, *args, **kw):
            if kw.get("tag", 0) == 0 and t.dtype == torch.uint8 and t.numel() > 8:  # data, not a digest vector
                t = t.clone()
                t[3] ^= 0x10
            return isend(t, *args, **kw)

        dist.isend = flipped
    try:
        step(proc, a, b, state, ahead=True)
        verdict = "adopted"
    except MigrationMismatch:
        verdict = "refused"
    q.put((proc, (verdict, proc == 2 or holds_exactly(state, layout(2)[proc], full))))
    dist.barrier()
    dist.destroy_process_group()


def test_a_piece_corrupted_on_the_wire_is_refused_on_every_process() -> None:
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_wire, 3)
    assert got == {0: ("refused", True), 1: ("refused", True), 2: ("refused", True)}


def _staged(proc: int, port: int, q) -> None:
    """A chain of TP and process changes, with the staging buffers planned and allocated ahead."""
    import torch.distributed as dist

    _init(proc, port)
    full = full_tensors()
    steps = [(2, [0, 1]), (1, [1, 2]), (2, [2, 0]), (2, [0, 1])]
    out = []
    for window in (None, 1, 3000):  # the engine's window, one message per window, a few per window
        state = start(proc, *steps[0], full)
        for a, b in zip(steps, steps[1:]):
            nm, new, _ = step(proc, a, b, state, staged=True, window_bytes=window)
            used = new.stats.staging_bytes
            out.append((nm is None or holds_exactly(new, nm, full), new.stats.staging_fresh,
                        used <= new.staging_planned, used > 0))
            state = dict(new)
    q.put((proc, out))
    dist.barrier()
    dist.destroy_process_group()


def test_staging_planned_ahead_covers_every_transfer_so_none_is_allocated_inside_the_pause() -> None:
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_staged, 3)
    rows = [r for out in got.values() for r in out]
    assert all(exact for exact, _f, _u, _any in rows)
    assert [fresh for _e, fresh, _u, _any in rows] == [0] * len(rows)  # the planned bound always sufficed
    assert all(within for _e, _f, within, _any in rows)
    assert sum(used for _e, _f, _w, used in rows) >= len(rows) // 2  # packed and strided pieces did pass through


def _prepared(proc: int, port: int, q) -> None:
    """The transfer built ahead of the pause (as a runtime does while the old layout trains), then the
    old state changes before the pause: in place (an optimizer step), or its tensors replaced by new
    ones (a model that reallocates). Either way the pause moves the values of the pause."""
    import torch.distributed as dist

    _init(proc, port)
    full = full_tensors()
    doubled = {f: t * 2 for f, t in full.items()}
    a, b = (2, [0, 1]), (1, [1, 2])  # 1 keeps its shard and gathers the rest, 2 joins, 0 leaves
    out = []
    for how in ("in place", "replaced", "in place, release early"):
        def change(state: dict) -> None:
            for f in sorted(state):
                if how == "replaced":
                    state[f] = state[f] * 2
                else:
                    state[f].mul_(2)

        state = start(proc, *a, full)
        early = how.endswith("early")
        nm, new, _ = step(proc, a, b, state, ahead=True, staged=True, prepare=change, release_early=early,
                          window_bytes=(8 << 10) if early else None)
        out.append((how, nm is None or holds_exactly(new, nm, doubled), new.built_ahead, len(state) if early else None))
    q.put((proc, out))
    dist.barrier()
    dist.destroy_process_group()


def test_a_transfer_built_ahead_moves_the_values_of_the_pause_or_is_built_anew() -> None:
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_prepared, 3)
    for proc in (0, 1):  # old state held: built ahead unless the tensors it cut views of were replaced
        assert got[proc] == [("in place", True, True, None), ("replaced", True, False, None),
                             ("in place, release early", True, True, 0)], proc
    # the joiner holds no old state: its transfer built ahead always serves
    assert got[2] == [("in place", True, True, None), ("replaced", True, True, None),
                      ("in place, release early", True, True, 0)]
