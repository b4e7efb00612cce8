"""The per-step vote (launcher.runtime.vote) in real gloo process groups, with a real rank SIGKILLed at each
point of the protocol: every survivor ends on the same step, and it is the step the protocol says
(worked out here by hand, not by the code under test)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from launcher.runtime import vote as vote_mod
from launcher.runtime.vote import StepVote, dissemination_rounds
from launcher.wire.control import Control

STEPS = 6


class _KillAt:
    """The real messages, with SIGKILL on rank `rank` at vote `step`, before `point` (ready | tell)."""

    def __init__(self, me: int, kill: tuple[int, int, str] | None) -> None:
        self.me, self.kill, self.step = me, kill, 0

    def _maybe_die(self, point: str) -> None:
        if self.kill and self.kill == (self.me, self.step, point):
            os.kill(os.getpid(), signal.SIGKILL)

    def ready(self, flag, rank, n):
        self._maybe_die("ready")
        vote_mod.ready_messages(flag, rank, n)

    def tell(self, flag, rank, n):
        self._maybe_die("tell")
        vote_mod.tell_messages(flag, rank, n)


def _rank(rank: int, n: int, port: int, kill, out, apart: int | None = None) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.runtime.sockets import cut_collective_sockets

    ctl = Control("127.0.0.1", port)
    dist.init_process_group("gloo", store=ctl.world_store("w0"), rank=rank, world_size=n,
                            timeout=timedelta(seconds=30))
    links = _KillAt(rank, kill)
    voter, got = StepVote(ctl, links), []
    for step in range(STEPS):
        links.step = step
        agree = (step, 7, 2 ** 61 + (rank == apart and step == 4))  # rank `apart` differs in its last value at 4
        verdict = voter.vote("w0", step, rank, n, epoch=0, agree=agree)
        got.append((verdict.committed, verdict.event) + ((verdict.disagree,) if verdict.disagree else ()))
        if verdict.disagree:
            break
        if verdict.failure is not None or not verdict.committed:
            cut_collective_sockets(port)  # as a worker does (launcher.runtime.job._abandon)
            break
    out.put((rank, got))


def _run(n: int, kill=None, event: bool = False, apart: int | None = None) -> dict[int, list]:
    server = Control("127.0.0.1", 0, server=True)
    if event:
        server.post({"epoch": 0, "kind": "stop"})
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, n, server.port, kill, out, apart)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode is not None for p in procs), "a rank hung"
    got = {}
    while not out.empty():
        rank, steps = out.get()
        got[rank] = steps
    return got


def test_rounds_are_ceil_log2():
    assert [dissemination_rounds(n) for n in (1, 2, 3, 4, 5, 8, 9, 1024, 4096)] == [0, 1, 2, 2, 3, 3, 4, 10, 12]


@pytest.mark.parametrize("n", [1, 3, 5])
def test_every_rank_commits_every_step_and_learns_an_event_at_the_same_vote(n):
    got = _run(n, event=True)
    assert sorted(got) == list(range(n))
    assert all(steps == [(True, True)] * STEPS for steps in got.values())


@pytest.mark.parametrize("kill, committed", [
    ((2, 3, "ready"), 3),  # died before it was ready: nobody applies step 3
    ((0, 3, "tell"), 4),  # rank 0 settled "go", then died: everybody applies step 3
    ((4, 3, "tell"), None),  # a leaf died after it was ready: either outcome, the same for all
    ((1, 3, "tell"), None),  # an inner node of the answer's tree: its subtree settles by itself
])
def test_survivors_of_a_rank_killed_in_the_vote_hold_the_same_step(kill, committed):
    n = 5
    got = _run(n, kill)
    assert sorted(got) == [r for r in range(n) if r != kill[0]], f"a survivor did not report: {got}"
    held = {r: sum(1 for ok, _ in steps if ok) for r, steps in got.items()}
    assert len(set(held.values())) == 1, f"survivors hold different steps: {held}"
    if committed is not None:
        assert set(held.values()) == {committed}
    assert all(steps[:3] == [(True, False)] * 3 for steps in got.values())


@pytest.mark.parametrize("apart", [4])
def test_a_value_one_rank_holds_differently_stops_every_rank_at_that_vote(apart):
    """The values every rank must hold alike (the step, the optimizer's settings) ride on the ready messages:
    one rank's differs at vote 4, and every rank, the one at the far end of the dissemination included,
    learns it at that vote, and nobody applies the update."""
    n = 5
    got = _run(n, apart=apart)
    assert got == {r: [(True, False)] * 4 + [(False, False, (2,))] for r in range(n)}, got
