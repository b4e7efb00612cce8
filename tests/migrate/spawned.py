"""Run a function in N real processes that share a free rendezvous port; collect what each puts on the queue."""
from __future__ import annotations

from collections.abc import Callable


def context():
    """The multiprocessing context the tests start real worker processes with: a forkserver with torch
    preloaded, so each process is forked from a server that imported torch once per test session instead of
    being a fresh interpreter importing it again (1.5-3 s of CPU per process on 2 cores)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def run_spawned(target: Callable, n: int) -> dict:
    """target(rank, port, queue) puts (key, value) once; returns {key: value}; every process must exit 0."""
    from migrate.localrun import free_port

    ctx = context()
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, port, q)) for r in range(n)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got
