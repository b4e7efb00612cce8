"""The shared transfer layer (migrate.transfer) under the manifest engine, in 3 real processes: early
release moves state bit-exact and frees the old tensors; a process dying half way leaves the others'
old state whole. Pieces are big enough to take every path: direct, packed, and strided (staging).
The oracle is the full tensors each piece is cut from (seeded per name), not the code under test."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from migrate.manifest import Manifest
from migrate.transfer import narrow_is_contiguous
from tests.migrate import test_reshard as reshard_tests
from tests.migrate.test_reshard import cut

D, HIDDEN = 128, 512  # up.weight 256 KiB, down.weight cut along dim 1: strided pieces


def layout(tp: int) -> list[Manifest]:
    return reshard_tests.layout(tp, D, HIDDEN)


def full_tensors() -> dict[str, torch.Tensor]:
    return reshard_tests.full_tensors(D, HIDDEN)


def _move(proc: int, steps, full, state, **kw):
    """Run the layout changes `steps` [(tp, processes), ...]; yields (new manifest or None, new state)."""
    from migrate.reshard import execute, plan_transfers

    for (tp_a, procs_a), (tp_b, procs_b) in zip(steps, steps[1:]):
        old_l, new_l = layout(tp_a), layout(tp_b)
        old_ms = [old_l[i % tp_a] for i in range(len(procs_a))]
        new_ms = [new_l[i % tp_b] for i in range(len(procs_b))]
        same = {r: procs_a.index(p) for r, p in enumerate(procs_b) if p in procs_a}
        o = procs_a.index(proc) if proc in procs_a else None
        n = procs_b.index(proc) if proc in procs_b else None
        old_state = state
        state = execute(plan_transfers(old_ms, new_ms, same), o, n, state, old_ms[o] if o is not None else None,
                        new_ms[n] if n is not None else None, procs_a, procs_b, **kw)
        yield (new_ms[n] if n is not None else None), state, old_state


def _init(proc: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=proc, world_size=3, timeout=timedelta(seconds=30))


def _release_early(proc: int, port: int, q) -> None:
    import torch.distributed as dist

    _init(proc, port)
    full = full_tensors()
    steps = [(2, [0, 1]), (1, [1, 2]), (2, [2, 0])]
    first = layout(2)[steps[0][1].index(proc)] if proc in steps[0][1] else None
    state = {e.fqn: cut(full[e.fqn], e).clone() for e in first.entries} if first else {}
    ok = []
    # windows of 8 KiB: many windows, digests confirmed while later windows move
    for m, state, old_state in _move(proc, steps, full, state, release_early=True, window_bytes=8 << 10):
        exact = m is None or (set(state) == {e.fqn for e in m.entries}
                              and all(torch.equal(state[e.fqn], cut(full[e.fqn], e)) for e in m.entries))
        ok.append((exact, len(old_state)))  # released early: nothing old is left
    q.put((proc, ok))
    dist.barrier()
    dist.destroy_process_group()


def test_release_early_moves_bit_exact_and_frees_every_old_tensor() -> None:
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_release_early, 3)
    assert got == {0: [(True, 0), (True, 0)], 1: [(True, 0), (True, 0)], 2: [(True, 0), (True, 0)]}


def _dies_half_way(proc: int, port: int, q) -> None:
    from migrate.transfer import TransferError

    _init(proc, port)
    full = full_tensors()
    steps = [(2, [0, 1]), (1, [1, 2])]  # process 0 sends its half to 1 and to 2, one window each
    old = layout(2)[proc] if proc in (0, 1) else None
    state = {e.fqn: cut(full[e.fqn], e).clone() for e in old.entries} if old else {}

    def die(window: int) -> None:
        if proc == 0 and window == 1:
            q.put((proc, "died"))
            q.close()
            q.join_thread()
            os._exit(0)

    try:
        for _ in _move(proc, steps, full, state, window_bytes=1, on_window=die):
            pass
        q.put((proc, "finished"))
    except TransferError:
        intact = old is None or (set(state) == {e.fqn for e in old.entries}
                                 and all(torch.equal(state[e.fqn], cut(full[e.fqn], e)) for e in old.entries))
        q.put((proc, f"failed, old state intact: {intact}"))
    q.close()
    q.join_thread()
    os._exit(0)  # the group is broken by the dead peer: nothing to tear down


def test_a_process_dying_half_way_leaves_the_old_state_intact() -> None:
    from tests.migrate.spawned import run_spawned

    got = run_spawned(_dies_half_way, 3)
    assert got == {0: "died", 1: "failed, old state intact: True", 2: "failed, old state intact: True"}


def _copies_and_receives_only(proc: int, port: int, q) -> None:
    import torch.distributed as dist

    _init(proc, port)
    full = full_tensors()
    steps = [(2, [0, 1]), (1, [1])]  # process 1 copies its half, receives the other (strided), sends nothing
    old = layout(2)[proc] if proc in (0, 1) else None
    state = {e.fqn: cut(full[e.fqn], e).clone() for e in old.entries} if old else {}
    (m, new, _old), = _move(proc, steps, full, state)
    exact = m is None and not new or m is not None and set(new) == {e.fqn for e in m.entries} and all(
        torch.equal(new[e.fqn], cut(full[e.fqn], e)) for e in m.entries)
    q.put((proc, exact))
    dist.barrier()
    dist.destroy_process_group()


def test_a_process_that_copies_and_receives_but_sends_nothing_gets_its_whole_piece() -> None:
    """Its staging (a strided receive, none given ahead, no send to say where its tensors live) is made
    on the CPU, and its copy and its receive fill one new tensor."""
    from tests.migrate.spawned import run_spawned

    assert run_spawned(_copies_and_receives_only, 3) == {0: True, 1: True, 2: True}


@pytest.mark.parametrize("shape,dim,length", [((4, 6), 0, 2), ((4, 6), 1, 3), ((4, 6), 1, 6), ((1, 6), 1, 2),
                                              ((3, 1, 5), 2, 2), ((2, 3, 4), 1, 3), ((5,), 0, 1)])
def test_contiguity_of_a_cut_is_known_without_the_tensor(shape, dim, length) -> None:
    assert narrow_is_contiguous(shape, dim, length) == torch.zeros(shape).narrow(dim, 0, length).is_contiguous()
