"""The store's share of live mode's control plane at full N, with simulated ranks and the real code paths.

Ranks 1..N-1 are threads in a few processes, each with its own store connection as each worker has one,
and send the store what a training rank sends it: its time-based heartbeat (StepVote.heartbeat); on a
failure, what a rank whose vote failed sends (settle "no", the abort mark, its suspicion, its step: the
Job's _abandon). Rank 0 is its own process and runs the real step boundary: EventBoundary.due,
StepVote.heartbeat and StepVote.vote, with the vote's point-to-point messages left out (launcher.controlbench.
groups measures them on real process groups). The launcher's poll reads what it reads every --poll. The
server is its own process, so its CPU can be read from /proc.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import threading
import time

from launcher.controlbench.counting import CountingStore
from launcher.runtime.events import EventBoundary
from launcher.runtime.vote import HEARTBEAT_S, StepVote
from launcher.wire.control import Control
from launcher.wire.env import ENV_STORE_SECRET
from launcher.wire.guarded_store import new_secret

HOST = "127.0.0.1"
WORLD = "w0"


class _NoLinks:
    """The vote's messages, left out: their cost is measured on real process groups."""

    @staticmethod
    def ready(flag, rank, n):
        pass

    @staticmethod
    def tell(flag, rank, n):
        pass


def _server(out, stop, secret: str) -> None:
    ctl = Control(HOST, 0, server=True, timeout_s=600, secret=secret)
    out.put((os.getpid(), ctl.port))
    stop.wait()


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ranks(port: int, ranks: list[int], out, stop, fail, step) -> None:
    """Ranks `ranks` as threads: heartbeats while training, the failure path's store traffic on `fail`."""
    threading.stack_size(256 * 1024)
    conns = [Control(HOST, port, timeout_s=600) for _ in ranks]
    for c in conns:
        c.store = CountingStore(c.store)
    out.put(("connected", len(ranks)))
    done: list[float] = []  # when each rank's failure traffic was all sent
    abandoned: list[float] = []  # when each rank knew its step was abandoned
    local_stop, local_fail = threading.Event(), threading.Event()

    def run(rank: int, ctl: Control) -> None:
        vote = StepVote(ctl)
        if local_stop.wait(random.random() * HEARTBEAT_S):  # ranks do not beat in step
            return
        while not local_stop.is_set():
            vote.heartbeat(rank, step.value, rank)
            local_stop.wait(HEARTBEAT_S)
        if local_fail.is_set():  # a peer vanished: what launcher.runtime.job._abandon sends after a failed vote
            ctl.settle_step(WORLD, step.value, "no")  # the step is abandoned here
            abandoned.append(time.time())
            ctl.abort_world(WORLD)
            ctl.suspect(WORLD, rank, "RuntimeError: bench: a peer vanished")
            vote.heartbeat(rank, step.value, None, force=True)
            done.append(time.time())

    threads = [threading.Thread(target=run, args=(r, c), daemon=True) for r, c in zip(ranks, conns)]
    started = time.time()
    for t in threads:
        t.start()
    while not (stop.wait(0.05) or fail.wait(0.05)):
        pass
    beating_s = time.time() - started
    if fail.is_set():
        local_fail.set()
    local_stop.set()
    for t in threads:
        t.join(timeout=120)
    out.put(("done", {"ops": sum(c.store.ops for c in conns), "failed_at": max(done, default=None),
                      "abandoned_at": max(abandoned, default=None),
                      "beats_per_s": (sum(c.store.ops for c in conns) - 4 * len(done)) / beating_s / len(ranks)}))


def _rank0(port: int, n: int, seconds: float, out, go, step) -> None:
    """Rank 0's step boundaries back to back (no compute): their store time is the store's share of a step."""
    ctl = Control(HOST, port, timeout_s=600)
    ctl.store = CountingStore(ctl.store)
    ctl.device = 0
    vote = StepVote(ctl, _NoLinks())
    events = EventBoundary(ctl, vote, prepare=lambda ev: None, log=lambda msg: None)
    epoch = committed = done = 0
    durations, seen = [], {}
    go.wait()
    ops0, t_start = ctl.store.ops, time.perf_counter()
    while time.perf_counter() - t_start < seconds:
        t0 = time.perf_counter()
        vote.heartbeat(0, done, 0)  # launcher.runtime.job.next_step, as for a training rank 0
        ev = events.due(epoch, done, committed == done > 0, 0, 0)
        if ev is not None and done >= events.at:
            events.clear()
            epoch += 1
        done += 1
        step.value = done
        verdict = vote.vote(WORLD, done - 1, 0, n, epoch)  # the optimizer's pre-step hook
        committed, events.told = done, verdict.event
        if verdict.event and epoch not in seen:
            seen[epoch] = time.time()
            out.put(("seen", epoch, seen[epoch]))
        durations.append(time.perf_counter() - t0)
    out.put(("rank0", {"durations": durations, "ops": ctl.store.ops - ops0}))


def _launcher_poll(port: int, n: int, poll_s: float, stop: threading.Event, counts: dict) -> None:
    """What the launcher reads every poll in live mode (launcher.loop.launcher._poll_live), counted from
    its steady state on: until every rank has beaten once, the step keys are read one by one (Control._values),
    and on a loaded machine those first polls are most of a short run's."""
    ctl = Control(HOST, port, timeout_s=600)
    keys = [f"step/{d}" for d in range(n)]
    while not ctl.store.check(keys) and not stop.wait(poll_s):
        pass
    ctl.store = CountingStore(ctl.store)
    devices = list(range(n))
    polls, seen = 0, 0
    while not stop.wait(poll_s):
        ctl.steps(devices)
        ctl.suspect_count(WORLD)
        _, seen = ctl.take_losses(seen)
        polls += 1
    counts.update(ops=ctl.store.ops, polls=polls)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(n: int, seconds: float = 10.0, processes: int = 8, poll_s: float = 0.2, say=print) -> dict:
    """The store's share at `n` ranks (see the module docstring); times in ms."""
    ctx = mp.get_context("spawn")
    q, stop, fail, go = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    step = ctx.Value("l", 0, lock=False)
    os.environ[ENV_STORE_SECRET] = secret = new_secret()  # the simulated ranks, spawned below, inherit it
    server = ctx.Process(target=_server, args=(q, stop, secret), daemon=True)
    server.start()
    server_pid, port = q.get(timeout=60)
    others = list(range(1, n))
    procs = [ctx.Process(target=_ranks, args=(port, others[i::processes], q, stop, fail, step), daemon=True)
             for i in range(min(processes, len(others)))]
    for p in procs:
        p.start()
    connected = 0
    while connected < len(others):
        kind, count = q.get(timeout=600)
        connected += count
        say(f"  {connected}/{n - 1} simulated ranks connected")
    rank0 = ctx.Process(target=_rank0, args=(port, n, seconds, q, go, step), daemon=True)
    rank0.start()
    admin = Control(HOST, port, timeout_s=600)
    time.sleep(HEARTBEAT_S * 1.5)  # every rank beats once before the clock starts
    poll_stop, poll_counts = threading.Event(), {}
    poller = threading.Thread(target=_launcher_poll, args=(port, n, poll_s, poll_stop, poll_counts), daemon=True)
    poller.start()
    cpu0, t0 = _cpu_s(server_pid), time.time()
    go.set()
    posted, seen, r0 = {}, {}, None
    while r0 is None:
        if len(posted) == len(seen) and time.time() < t0 + seconds - 0.5:  # one event at a time
            e = len(posted)
            time.sleep(random.uniform(0.02, 0.1))
            posted[e] = time.time()
            admin.post({"epoch": e, "kind": "bench"})
        try:
            msg = q.get(timeout=0.01)
        except Exception:
            continue
        if msg[0] == "seen":
            seen[msg[1]] = msg[2]
        elif msg[0] == "rank0":
            r0 = msg[1]
    wall = time.time() - t0
    server_cpu = _cpu_s(server_pid) - cpu0
    poll_stop.set()
    poller.join()
    fail_at = time.time()
    fail.set()
    beats, failed_at, abandoned_at = [], [], []
    for _ in procs:
        kind, info = q.get(timeout=300)
        beats.append(info["beats_per_s"])
        if info["failed_at"]:
            failed_at.append(info["failed_at"])
            abandoned_at.append(info["abandoned_at"])
    stop.set()
    for p in (*procs, rank0, server):
        p.join(timeout=30)
    ms = [d * 1000 for d in r0["durations"]]
    agreement = [(seen[e] - posted[e]) * 1000 for e in seen if e in posted]
    return {
        "ranks": n, "steps": len(ms), "seconds": wall, "processes": len(procs) + 2,
        "store_step_ms": {"median": statistics.median(ms), "p90": _pct(ms, 0.9), "max": max(ms)},
        "rank0_store_ops_per_step": r0["ops"] / len(ms),
        "other_rank_store_ops_per_s": statistics.mean(beats) if beats else 0.0,
        "launcher_store_ops_per_poll": poll_counts.get("ops", 0) / max(poll_counts.get("polls", 0), 1),
        "event_to_rank0_ms": {"median": statistics.median(agreement) if agreement else None,
                              "max": max(agreement) if agreement else None, "events": len(agreement)},
        # every survivor at once: its step settled "no" (abandoned), then all its failure traffic sent
        "failure_settled_ms": (max(abandoned_at) - fail_at) * 1000 if abandoned_at else None,
        "failure_store_burst_ms": (max(failed_at) - fail_at) * 1000 if failed_at else None,
        "server_cpu_share": server_cpu / wall,
    }
