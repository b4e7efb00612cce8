"""Run a function in N real spawned processes that share a free rendezvous port; collect what each puts on the queue."""
from __future__ import annotations

from collections.abc import Callable


def run_spawned(target: Callable, n: int) -> dict:
    """target(rank, port, queue) puts (key, value) once; returns {key: value}; every process must exit 0."""
    import torch.multiprocessing as mp

    from migrate.localrun import free_port

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, port, q)) for r in range(n)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got
