"""Cross-memory reads (migrate.cma) and the transfer layer's use of them (migrate.transfer), in real
processes. The oracle of a read is torch's own `contiguous()` of the view, and of a transfer the full
tensors each piece is cut from (tests.migrate.test_reshard), not the code under test."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from migrate import cma
from tests.migrate import test_transfer as tt
from tests.migrate.test_reshard import cut


def _read_own(view: torch.Tensor) -> torch.Tensor:
    into = torch.empty(view.numel(), dtype=view.dtype)
    cma.read(os.getpid(), into.view(torch.uint8) if into.numel() else into, cma.describe(view))
    return into.view(view.shape)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), data=st.data())
def test_a_described_view_reads_back_as_its_contiguous_copy(shape, data) -> None:
    base = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).view(shape)
    dim = data.draw(st.integers(0, len(shape) - 1))
    lo = data.draw(st.integers(0, shape[dim] - 1))
    length = data.draw(st.integers(1, shape[dim] - lo))
    view = base.narrow(dim, lo, length)
    if data.draw(st.booleans()) and len(shape) > 1:  # a second cut along another dimension
        other = (dim + 1) % len(shape)
        view = view.narrow(other, 0, data.draw(st.integers(1, shape[other])))
    assert torch.equal(_read_own(view), view.contiguous())


def test_a_strided_view_of_many_rows_is_read_in_calls_of_at_most_iov_max_runs() -> None:
    base = torch.arange(3000 * 8, dtype=torch.int64).view(3000, 8)
    view = base[:, 2:5]  # 3000 runs of 24 bytes
    assert len(cma.runs(cma.describe(view))) == 3000
    assert torch.equal(_read_own(view), view.contiguous())


def test_a_read_into_a_buffer_of_another_size_is_refused() -> None:
    view = torch.arange(10, dtype=torch.float32)
    with pytest.raises(OSError, match="describes 40 bytes where 36 are expected"):
        cma.read(os.getpid(), torch.empty(9, dtype=torch.float32), cma.describe(view))


def test_reading_a_process_that_is_gone_names_the_cause() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    view = torch.arange(4, dtype=torch.float32)
    with pytest.raises(OSError, match="No such process"):
        cma.read(pid, torch.empty(4, dtype=torch.float32), cma.describe(view))


ME = [1, 77, 4026531836, 1000, 500]


@pytest.mark.parametrize("them,ok", [
    ([1, 77, 4026531836, 1000, 501], True),
    ([0, 77, 4026531836, 1000, 501], False),  # the peer turned it off or may not
    ([1, 78, 4026531836, 1000, 501], False),  # another host (kernel boot)
    ([1, 77, 4026531999, 1000, 501], False),  # another PID namespace: its pid means nothing here
    ([1, 77, 4026531836, 1001, 501], False),  # another user
    ([1, 77, 4026531836, 1000, 500], False),  # itself
])
def test_two_processes_read_each_other_only_when_both_can_and_share_host_namespace_and_user(them, ok) -> None:
    assert cma.readable(ME, them) is ok
    assert cma.readable(them, ME) is ok  # both ends decide alike
    assert not cma.readable([0, *ME[1:]], them)


@pytest.mark.parametrize("raw,on", [(None, True), ("1", True), (" 0 ", False)])
def test_elastic_cma_turns_reads_on_and_off(raw, on) -> None:
    assert cma.enabled_from_env({} if raw is None else {cma.ENV_CMA: raw}) is on
    if not on:
        assert not cma.capable({cma.ENV_CMA: raw})


@pytest.mark.parametrize("raw", ["yes", "2", "off"])
def test_elastic_cma_refuses_what_it_cannot_use(raw) -> None:
    with pytest.raises(ValueError, match=r"\$ELASTIC_CMA must be 1 .* or 0 .*, got"):
        cma.enabled_from_env({cma.ENV_CMA: raw})


def test_this_machine_can_read_a_peer() -> None:
    """The test machine (no Yama, no seccomp filter) must take the fast path, or every figure of the
    bench measures the sockets instead."""
    assert cma.capable({})


#: tp2 on processes 0 and 1 -> tp1 on 1 and 2: 0 sends to 1 and 2, 1 copies and sends to 2; the
#: row-parallel weight's halves land in strided places (read into staging)
SHRINK = [(2, [0, 1]), (1, [1, 2])]
#: tp1 on process 0 -> tp2 on 1 and 2: the row-parallel weight leaves as strided column slices into
#: contiguous new tensors (written by the sender in safe mode)
SPLIT = [(1, [0]), (2, [1, 2])]


def _refuse(*_args):
    raise OSError(1, "Operation not permitted")


def _moves(proc: int, port: int, q, off: tuple[int, ...], fail: tuple[int, ...], steps=SHRINK, **kw) -> None:
    import torch.distributed as dist

    from migrate.transfer import TransferError

    if proc in off:
        os.environ[cma.ENV_CMA] = "0"
    if proc in fail:
        cma.read = cma.write = _refuse
    tt._init(proc, port)
    full = tt.full_tensors()
    first = tt.layout(steps[0][0])
    old = first[steps[0][1].index(proc)] if proc in steps[0][1] else None
    state = {e.fqn: cut(full[e.fqn], e).clone() for e in old.entries} if old else {}
    try:
        (m, new, _old), = tt._move(proc, steps, full, state, **kw)
    except TransferError as exc:
        intact = old is None or all(torch.equal(state[e.fqn], cut(full[e.fqn], e)) for e in old.entries)
        from migrate.transfer import AWAITED_WRITES

        q.put((proc, (f"failed: {str(exc)[:60]}", intact, len(AWAITED_WRITES))))
        q.close()
        q.join_thread()
        if proc in fail:  # up until its peers have read its "not done" (its exit would cut them off)
            import time
            time.sleep(3)
        os._exit(0)
    exact = m is None or all(torch.equal(new[e.fqn], cut(full[e.fqn], e)) for e in m.entries)
    s = new.stats
    from migrate.transfer import AWAITED_WRITES

    assert not AWAITED_WRITES  # every write confirmed: nothing held
    q.put((proc, (exact, s.cma_bytes, s.bytes_sent + s.bytes_received, s.cma_written)))
    dist.barrier()
    dist.destroy_process_group()


def _run(off: tuple[int, ...] = (), fail: tuple[int, ...] = (), **kw) -> dict:
    from functools import partial

    from tests.migrate.spawned import run_spawned

    return run_spawned(partial(_moves, off=off, fail=fail, **kw), 3)


def test_processes_of_one_host_read_every_unpacked_message_from_each_other() -> None:
    got = _run()
    assert all(exact for exact, *_ in got.values())
    # every byte but the packed small pieces' (biases, norms: under 64 KiB a pair) is read, none sent
    for proc, (_e, read, total, written) in got.items():
        assert 0.9 * total < read < total and written == 0, (proc, read, total)


def test_a_process_with_reads_turned_off_gets_and_gives_everything_over_sockets() -> None:
    got = _run(off=(1,))
    assert all(exact for exact, *_ in got.values())
    assert got[1][1] == 0  # process 1: nothing read, by it or from it
    assert 0 < got[0][1] < got[0][2] and 0 < got[2][1] < got[2][2]  # 0 -> 2 still read


def test_a_read_the_kernel_refuses_fails_the_transfer_at_both_ends_and_keeps_the_old_state() -> None:
    got = _run(fail=(2,))
    assert got[2][0].startswith("failed: could not read the memory of rank"), got
    for proc in (0, 1):  # the processes it read: told, not left waiting
        assert got[proc][0].startswith("failed: rank 2 could not read this process's memory"), got
    assert all(intact for _msg, intact, _held in got.values())


def test_strided_sources_are_written_by_their_sender_into_contiguous_new_tensors() -> None:
    got = _run(steps=SPLIT)
    assert all(exact for exact, *_ in got.values())
    (_e, moved0, total0, written0), (_e1, moved1, _t1, written1), (_e2, moved2, _t2, written2) = (
        got[0], got[1], got[2])
    assert 0 < written0 < moved0 < total0  # the column slices written, the rest read, the small ones packed
    assert written0 == written1 + written2 and written1 > 0 and written2 > 0


def test_with_release_early_strided_sources_are_read_instead() -> None:
    """Release early makes new tensors only when their window comes: none exists to write into ahead."""
    got = _run(steps=SPLIT, release_early=True, window_bytes=8 << 10)
    assert all(exact for exact, *_ in got.values())
    assert all(written == 0 and moved > 0 for _e, moved, _t, written in got.values() if _t), got


def test_a_write_the_kernel_refuses_fails_the_transfer_at_both_ends_and_keeps_the_old_state() -> None:
    got = _run(steps=SPLIT, fail=(0,))
    assert got[0][0].startswith("failed: could not write into the memory of rank"), got
    for proc in (1, 2):
        assert got[proc][0].startswith("failed: rank 0 could not write into this process's memory"), got
        assert got[proc][2] > 0  # the new tensors it gave to be written in stay alive past the failure
    assert all(intact for _msg, intact, _held in got.values())
