"""gloo's I/O threads kept from spinning on the cores the trainers need.

gloo's TCP transport serves each process group from a thread of its own (named `gloo_tcp_loop`) that
waits in a level-triggered epoll and, to stay free of deadlocks, handles a ready socket only when it
gets that connection's lock at once (try_lock). While the trainer's thread holds the lock (posting a
send or a receive) the socket stays ready and the I/O thread calls epoll_wait again and again. With
more worker processes than cores the lock holder is often preempted, and the I/O thread spins for
the rest of its time slice (strace of two processes exchanging 48 KB messages in turn: runs of
epoll_wait returning the same unread socket; with other busy processes on the cores, 370-460 us of
system time in gloo's thread per message end, against 14 us of CPU in all when messages stream).

Measured on a 2-core machine, 8 workers training pp4tp2 (the reference GPT, hidden 384, the bench's
model; three runs of 6 steps each way, alternating): gloo's threads took 0.99-1.17 of the 2.98-3.86 CPU-s
of each 1.60-2.10 s step (30-33 %); at the lowest priority (nice 19) 0.28-0.30 CPU-s, and the step took
1.24-1.33 s. Such a thread still runs as soon as the trainer
thread of its core waits (for a message: then there is work for it), so the bulk transfer of a
migration, where these threads copy every byte, took as long either way (pp6tp4 -> pp4tp2 moving
0.95 GB: 0.57-0.67 s at either priority, python -m migrate.execbench).

The runtime lowers every such thread of its worker at each step boundary (a process group made since,
the trainer's or the script's own, is caught before its first step). $ELASTIC_GLOO_NICE sets the
niceness (1-19; 0 leaves the threads alone). Only the worker's own threads are touched, and only
downwards: an unprivileged process cannot raise a priority back, and never needs to."""
from __future__ import annotations

import os

ENV_GLOO_NICE = "ELASTIC_GLOO_NICE"
DEFAULT_NICE = 19
#: the name gloo's TCP transport gives its I/O threads (gloo/transport/tcp/loop.cc)
THREAD_NAME = "gloo_tcp_loop"


def nice_from_env(env=os.environ) -> int:
    """The niceness $ELASTIC_GLOO_NICE asks for (default 19); ValueError that says what is allowed."""
    raw = env.get(ENV_GLOO_NICE, "").strip()
    if not raw:
        return DEFAULT_NICE
    try:
        nice = int(raw)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"${ENV_GLOO_NICE} must be a whole number from 0 (leave gloo's I/O threads alone) to 19 "
                         f"(their lowest priority, the default), got {raw!r}")
    return nice


def thread_nice(tid: int) -> int:
    """The niceness of thread `tid` of this process (Linux keeps one per thread)."""
    return os.getpriority(os.PRIO_PROCESS, tid)


def gloo_threads() -> list[int]:
    """The ids of this process's gloo I/O threads (none where there is no procfs)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == THREAD_NAME:
                    out.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return out


class GlooThreads:
    """lower() at a step boundary: sets every gloo I/O thread of this process that is not yet at `nice`."""

    def __init__(self, nice: int | None = None) -> None:
        self.nice = nice_from_env() if nice is None else nice

    def lower(self) -> int:
        """Threads changed now (0 when none is new; a listing of /proc/self/task and one read per thread)."""
        if self.nice <= 0:
            return 0
        changed = 0
        for tid in gloo_threads():
            try:
                if thread_nice(tid) < self.nice:
                    os.setpriority(os.PRIO_PROCESS, tid, self.nice)
                    changed += 1
            except OSError:  # the thread ended meanwhile
                continue
        return changed
