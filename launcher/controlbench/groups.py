"""The vote's point-to-point messages on real gloo process groups: a step, an event, a failure.

Each of n processes is a rank with the real StepVote on the default process group and its own connection
to a real control-plane server, stepping with no compute. Measured: the vote's time per step, the time
from the launcher posting an event to the last rank told of it, and the time from one rank's SIGKILL (at
its vote, as a worker dies in its step) to the last survivor having abandoned its step (the vote failed,
it settled the step and did what launcher.runtime.job._abandon does: abort mark, suspicion, heartbeat,
its sockets cut so peers blocked on it fail too).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import statistics
import time
from datetime import timedelta

from launcher.runtime.events import EventBoundary
from launcher.runtime.sockets import cut_collective_sockets
from launcher.runtime.vote import StepVote, dissemination_rounds
from launcher.wire.control import Control

HOST = "127.0.0.1"


class _Timed:
    """The vote's real messages, with the time spent in them (the per-hop figure of the model)."""

    def __init__(self) -> None:
        from launcher.runtime import vote

        self.spent = 0.0
        self.ready, self.tell = self._timing(vote.ready_messages), self._timing(vote.tell_messages)

    def _timing(self, send):
        def timed(flag, rank, n):
            t0 = time.perf_counter()
            try:
                send(flag, rank, n)
            finally:
                self.spent += time.perf_counter() - t0

        return timed


def _rank(rank: int, n: int, port: int, seconds: float, kill_step_at: float, out, killed_at) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    ctl = Control(HOST, port, timeout_s=120)
    ctl.device = rank
    dist.init_process_group("gloo", store=ctl.world_store("w0"), rank=rank, world_size=n,
                            timeout=timedelta(seconds=60))
    links = _Timed()
    vote = StepVote(ctl, links)
    events = EventBoundary(ctl, vote, prepare=lambda ev: None, log=lambda msg: None)
    dist.barrier()
    epoch = committed = done = 0
    times, messages, told = [], [], {}
    victim = rank == n // 2 and n > 1
    t_start = time.perf_counter()
    while True:
        vote.heartbeat(rank, done, rank)
        ev = events.due(epoch, done, committed == done > 0, rank, rank)
        if ev is not None and done >= events.at:
            events.clear()
            epoch += 1
        done += 1
        running = time.perf_counter() - t_start
        if victim and running >= kill_step_at:
            killed_at.value = time.time()  # shared memory: a queue's put may not leave before the kill
            os.kill(os.getpid(), signal.SIGKILL)
        t0, links.spent = time.perf_counter(), 0.0
        verdict = vote.vote("w0", done - 1, rank, n, epoch)
        if verdict.failure is not None or not verdict.committed:  # launcher.runtime.job._abandon's traffic
            ctl.abort_world("w0")
            ctl.suspect("w0", rank, f"{type(verdict.failure).__name__}: {verdict.failure}")
            vote.heartbeat(rank, done - 1, None, force=True)
            cut_collective_sockets(port)
            out.put(("abandoned", rank, time.time()))
            break
        if running < seconds:
            times.append(time.perf_counter() - t0)
            messages.append(links.spent)
        committed, events.told = done, verdict.event
        if verdict.event and epoch not in told:
            told[epoch] = time.time()
        if n == 1 and running >= seconds:
            break
    out.put(("rank", rank, {"times": times, "messages": messages, "told": told}))


def measure(n: int, seconds: float = 5.0) -> dict:
    """n ranks vote back to back for `seconds` (the launcher posts an event every ~0.1 s), then one dies."""
    ctx = mp.get_context("spawn")
    server = Control(HOST, 0, server=True, timeout_s=120)
    q, killed_at = ctx.Queue(), ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_rank, args=(r, n, server.port, seconds, seconds + 0.5, q, killed_at), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    while server.steps([0]).get(0, 0) < 1:  # rank 0 beats every step: the group formed
        time.sleep(0.05)
    posted, t_end = {}, time.time() + seconds
    e = 0
    while time.time() < t_end - 0.3:
        time.sleep(0.1)
        posted[e] = time.time()
        server.post({"epoch": e, "kind": "bench"})
        e += 1
    got, abandoned = {}, []
    while len(got) < n - (n > 1):
        kind, rank, info = q.get(timeout=180)
        if kind == "abandoned":
            abandoned.append(info)
        else:
            got[rank] = info
    for p in procs:
        p.join(timeout=30)
    ms = [t * 1000 for info in got.values() for t in info["times"]]
    hops = 2 * dissemination_rounds(n)
    per_hop = [t * 1000 / hops for info in got.values() for t in info["messages"]] if hops else [0.0]
    killed = killed_at.value
    agreement = []
    for ev, at in posted.items():  # the last rank told of the event
        told = [info["told"][ev] for info in got.values() if ev in info["told"]]
        if len(told) == len(got):
            agreement.append((max(told) - at) * 1000)
    return {"processes": n, "vote_ms": {"median": statistics.median(ms), "p90": sorted(ms)[int(0.9 * len(ms))],
                                        "max": max(ms)},
            "hop_ms": statistics.median(per_hop),
            "event_to_agreement_ms": {"median": statistics.median(agreement) if agreement else None,
                                      "max": max(agreement) if agreement else None},
            "failure_to_abort_ms": (max(abandoned) - killed) * 1000 if killed and abandoned else None}
