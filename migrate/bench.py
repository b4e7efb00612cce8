"""`elastic bench`'s model sizing and the loopback ceiling it measures migrations against.

The scenarios (migrate.scenarios) run through the real launcher (launcher.bench); this module holds
what does not need the launcher: a model size that fits this machine's memory for all of them, and
the aggregate throughput N processes reach when every one of them sends and receives at once over
gloo on loopback (the most a migration among N devices can move per second here).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from migrate.layout import ModelSpec, ParallelConfig
from migrate.scenarios import PAPER_SCENARIOS
from migrate.train import TrainConfig

#: private memory of one idle worker process after importing torch and warming up (measured: ~240 MB)
WORKER_BASE_BYTES = 300 << 20
#: hidden sizes tried, largest first, when --hidden is not given
HIDDEN_CHOICES = (512, 384, 256, 128)


@dataclass(frozen=True)
class BenchConfig:
    layers: int = 48  # divisible by 16 and 6: every paper layout splits it evenly
    hidden: int = 384
    vocab: int = 8192
    seq_len: int = 32
    global_batch: int = 3  # splits over dp 1 and 3; few micro-batches keep a step short with 32 processes on 2 cores
    gpus_per_node: int = 8
    release_early: bool = False

    def model(self) -> ModelSpec:
        return ModelSpec(layers=self.layers, hidden=self.hidden, heads=8, vocab=self.vocab, seq_len=self.seq_len)

    def train(self) -> TrainConfig:
        return TrainConfig(global_batch=self.global_batch, micro_batch=1, seq_len=self.seq_len)


def estimated_peak_bytes(model: ModelSpec, prev: ParallelConfig, curr: ParallelConfig) -> int:
    """A generous estimate of the memory a scenario needs at its peak: every worker's base, the old
    layout's replicas (params, grads, two moments), and the new layout's state arriving."""
    params = model.state_bytes // 3  # param + exp_avg + exp_avg_sq, all fp32
    workers = max(prev.world_size, curr.world_size)
    return workers * WORKER_BASE_BYTES + params * (4 * prev.dp + 3 * curr.dp)


def mem_available() -> int:
    """MemAvailable of this machine in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def fit_hidden(base: BenchConfig, scenarios: list[str], budget: int) -> BenchConfig | None:
    """The largest hidden size whose every scenario's estimated peak stays within `budget` bytes."""
    from dataclasses import replace

    for h in HIDDEN_CHOICES:
        cfg = replace(base, hidden=h)
        model = cfg.model()
        if all(estimated_peak_bytes(model, *map(ParallelConfig.parse, PAPER_SCENARIOS[s])) <= budget
               for s in scenarios):
            return cfg
    return None


def _ring_worker(rank: int, n: int, port: int, nbytes: int, rounds: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    out = torch.ones(nbytes, dtype=torch.uint8)
    into = torch.empty(nbytes, dtype=torch.uint8)  # allocated ahead, as the executor's buffers are
    best = float("inf")
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, out, (rank + 1) % n), dist.P2POp(dist.irecv, into, (rank - 1) % n)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    if rank == 0:
        queue.put(n * nbytes / best)
    dist.barrier()
    dist.destroy_process_group()


def run_forked(target, nprocs: int, args: tuple, results: int, timeout: float = 300) -> list:
    """Fork `nprocs` processes running target(rank, nprocs, port, *args, queue) around one free
    rendezvous port; return the first `results` items they put on the queue.

    Forked, not spawned: a child needs no fresh torch import (seconds each on 2 cores); call it
    before this process starts threads of its own (the launcher's control store)."""
    from migrate.localrun import free_port

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, nprocs, port, *args, queue)) for r in range(nprocs)]
    for p in procs:
        p.start()
    try:
        return [queue.get(timeout=timeout) for _ in range(results)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def loopback_ceiling(nprocs: int, nbytes: int = 32 << 20, rounds: int = 7) -> float:
    """Aggregate bytes/s of `nprocs` processes that each send `nbytes` to the next and receive from the
    previous at the same time (gloo, loopback, buffers allocated ahead; best of `rounds`). On a shared
    2-core machine it still moves from one minute to the next (16 and 24 processes: 2.6 to 4.8 GB/s),
    so read a share of it with the ceiling it was taken against."""
    return run_forked(_ring_worker, nprocs, (nbytes, rounds), 1)[0]
