"""The all-or-nothing commit of every optimizer step, carried by the training world's own process group.

Why not the launcher's store: a vote there cost every rank a few round trips a step, and the one store
serves them one after another (0.17 ms per rank: 174 ms a step at 1,024 ranks). Here a step costs every
rank 2 * ceil(log2 N) small point-to-point messages and rank 0 alone a fixed number of store operations,
so the store's share does not grow with the job (`elastic bench-control` measures both).

The vote on the update of step k (the optimizer's pre-step hook: every rank's gradients are reduced):
 1. ready: a dissemination all-reduce (max), ceil(log2 N) rounds; a rank gets out of it only once every rank
    has entered it, that is once every rank is ready to apply its update. It carries what every rank must
    hold alike (`agree`: the step, fingerprints of the optimizer's settings), each value v as (v, -v), so
    every rank learns the max and the min of each at no extra message: where they differ, nobody applies
    the update and every rank's verdict names the values that disagree (a worker that joined with a
    schedule of its own would otherwise train on with another learning rate, in silence).
 2. settle: rank 0 sets `c/<world>/<k>` to "go" with one compare-and-set on the store, and looks for the
    next event there (one check).
 3. tell: rank 0's answer (go, event posted) goes down a binomial tree to every rank.
A rank whose message fails (a peer died and its sockets closed, or a failing peer cut them) settles the
same key to "no" with the same compare-and-set, and whichever landed first stands for everyone. "go" won:
rank 0 got out of step 1, so every rank was ready, and this rank applies its update too (its world is
broken all the same, it waits for the recovery). "no" won: nobody applies it, since nobody gets out of
step 3 before rank 0 settled. So the survivors of any failure hold the same step.

Events: rank 0's answer says whether the next event is posted, so every rank learns of it at the same vote
and takes the same boundary (launcher.runtime.job). Heartbeats are time-based: rank 0 publishes its
finished steps at every step (what the launcher shows), every other rank every HEARTBEAT_S.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from launcher.wire.control import Control

HEARTBEAT_S = 1.0  # a rank other than 0 publishes its finished steps at most this often
TAG = 0x5E1  # the vote's point-to-point messages, apart from a pipeline's on the same process group


@dataclass(frozen=True)
class Verdict:
    """The outcome of one step's vote, the same on every rank (but `failure` and `event`)."""

    committed: bool  # apply the update
    event: bool = False  # rank 0 saw the next event posted (told to every rank that got the answer)
    failure: BaseException | None = None  # a peer failed during the vote: the world is broken
    disagree: tuple[int, ...] = ()  # indices of the `agree` values the ranks do not hold alike (not committed)


def dissemination_rounds(n: int) -> int:
    """Rounds of the ready all-reduce (and depth of the answer's tree) among n ranks: ceil(log2 n)."""
    return max(n - 1, 0).bit_length()


class StepVote:
    """One rank's side of the per-step vote (see the module docstring). `links` carries steps 1 and 3
    (ready, tell: the default process group's point-to-point messages); the bench passes a stand-in where
    thousands of simulated ranks cannot each be a process."""

    def __init__(self, ctl: Control, links=None) -> None:
        self.ctl = ctl
        self.ready, self.tell = (ready_messages, tell_messages) if links is None else (links.ready, links.tell)
        self._beat = float("-inf")
        self._stamped: set[str] = set()  # worlds whose first commit rank 0 stamped

    def heartbeat(self, device: int, step: int, rank: int | None, force: bool = False) -> None:
        """Publish this worker's finished steps: rank 0 every step, the others every HEARTBEAT_S."""
        now = time.monotonic()
        if force or rank == 0 or now - self._beat >= HEARTBEAT_S:
            self.ctl.set_step(device, step)
            self._beat = now

    def vote(self, world: str, step: int, rank: int, n: int, epoch: int, agree: tuple[int, ...] = ()) -> Verdict:
        """Vote on the update after `step` finished steps of `world` (n ranks); epoch: the next event;
        agree: non-negative values below 2**62 every rank must hold alike (see the module docstring)."""
        import torch

        flag = torch.zeros(2 + 2 * len(agree), dtype=torch.int64)
        for i, v in enumerate(agree):
            flag[2 + 2 * i], flag[3 + 2 * i] = v, -v
        try:
            self.ready(flag, rank, n)
            apart = tuple(i for i in range(len(agree)) if int(flag[2 + 2 * i] + flag[3 + 2 * i]) != 0)
            if apart:  # every rank holds the same max and min: every rank stops here, none applies it
                if rank == 0:
                    self.ctl.settle_step(world, step, "no")
                return Verdict(False, disagree=apart)
            if rank == 0:
                if step > 0:  # every rank is past the previous vote: its key goes
                    self.ctl.drop_step_vote(world, step - 1)
                go = self.ctl.settle_step(world, step, "go")
                flag[0], flag[1] = int(go), int(go and self.ctl.event_posted(epoch))
            self.tell(flag, rank, n)
        except RuntimeError as exc:  # a peer failed: whichever settled first stands for everyone
            return Verdict(self.ctl.settle_step(world, step, "no"), failure=exc)
        if rank == 0 and flag[0]:
            self.ctl.stamp_commit(world, first=world not in self._stamped)
            self._stamped.add(world)
        return Verdict(bool(flag[0]), bool(flag[1]))


def ready_messages(flag, rank: int, n: int) -> None:
    """Dissemination all-reduce (max): in round i, message rank + 2**i, hear from rank - 2**i and keep the
    larger of each value. After round i a rank holds the max over 2**(i+1) consecutive ranks (max does
    not mind ranks counted twice), so after ceil(log2 n) rounds every rank holds the max over all."""
    import torch
    import torch.distributed as dist

    got, k = torch.zeros_like(flag), 1
    while k < n:
        out = dist.isend(flag, (rank + k) % n, tag=TAG)
        into = dist.irecv(got, (rank - k) % n, tag=TAG)
        out.wait()
        into.wait()
        torch.maximum(flag, got, out=flag)
        k <<= 1


def tell_messages(flag, rank: int, n: int) -> None:
    """Binomial tree from rank 0: in round i, ranks below 2**i send to rank + 2**i."""
    import torch.distributed as dist

    k = 1
    while k < n:
        if rank < k and rank + k < n:
            dist.send(flag, rank + k, tag=TAG)
        elif k <= rank < 2 * k:
            dist.recv(flag, rank - k, tag=TAG)
        k <<= 1
