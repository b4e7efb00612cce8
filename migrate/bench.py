"""`elastic bench`: the paper's six reconfigurations, migrated directly and through checkpoints.

Every figure comes from real processes on this machine (one per device, gloo on loopback):
the direct migration through `localrun`, the checkpoint paths through `baselines`, and the
point-to-point ceiling from two processes exchanging a buffer with batch_isend_irecv.
"""
from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from migrate.layout import ModelSpec, ParallelConfig
from migrate.localrun import Scenario, free_port, run_scenario
from migrate.train import TrainConfig

PAPER_SCENARIOS = {
    "pp8tp1-pp16tp1": ("pp8tp1", "pp16tp1"),
    "pp4tp2-pp4tp4": ("pp4tp2", "pp4tp4"),
    "pp4tp4-pp4tp2": ("pp4tp4", "pp4tp2"),
    "pp4tp2-pp6tp4": ("pp4tp2", "pp6tp4"),
    "pp6tp4-pp4tp2": ("pp6tp4", "pp4tp2"),
    "pp4tp2dp3-pp4tp8dp1": ("pp4tp2dp3", "pp4tp8dp1"),
}


@dataclass(frozen=True)
class BenchConfig:
    layers: int = 48
    hidden: int = 512
    vocab: int = 8192
    seq_len: int = 32
    gpus_per_node: int = 8
    release_early: bool = False

    def model(self) -> ModelSpec:
        return ModelSpec(layers=self.layers, hidden=self.hidden, heads=8, vocab=self.vocab, seq_len=self.seq_len)

    def train(self) -> TrainConfig:
        return TrainConfig(global_batch=24, micro_batch=1, seq_len=self.seq_len)  # splits over dp 1, 2, 3


def _p2p_worker(rank: int, port: int, nbytes: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    best = 0.0
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, buf, 1 - rank)
        for req in dist.batch_isend_irecv([op]):
            req.wait()
        dist.barrier()
        best = max(best, nbytes / (time.perf_counter() - t0))
    if rank == 1:
        queue.put(best)
    dist.destroy_process_group()


def p2p_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s that batch_isend_irecv reaches between two processes (best of three, buffers preallocated)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, nbytes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    value = queue.get(timeout=300)
    for p in procs:
        p.join()
    return value


def run_etc(cfg: BenchConfig, prev: ParallelConfig, curr: ParallelConfig) -> dict:
    sc = Scenario(cfg.model(), prev, curr, cfg.train(), steps_before=1, steps_after=1,
                  gpus_per_node=cfg.gpus_per_node, timeout_s=300, release_early=cfg.release_early)
    reports = run_scenario(sc, timeout_s=1800)
    errors = [r.error for r in reports if r.error]
    phases = ("plan", "build_groups", "execute", "rebuild", "other")
    # every device starts after a barrier; the migration lasts as long as its slowest device
    per_device = [sum(r.phases.get(k, 0.0) for k in phases) for r in reports]
    worst = max(range(len(reports)), key=lambda i: per_device[i])
    execute_s = max(r.phases.get("execute", 0.0) for r in reports)
    moved = sum(r.bytes_received for r in reports)
    ratios = [r.peak_bytes / r.steady_bytes for r in reports if r.steady_bytes]
    return {
        "etc_s": per_device[worst],
        "phases": {k: reports[worst].phases.get(k, 0.0) for k in phases},
        "execute_s": execute_s,
        "bytes_moved": moved,
        "execute_bytes_per_s": moved / execute_s if execute_s else 0.0,
        "peak_mem_ratio": max(ratios, default=0.0),
        "bit_exact": not errors,
        "errors": errors,
        "losses_after": next((r.losses_after for r in reports if r.losses_after and r.losses_after[0] is not None), []),
    }


def run_scenario_bench(name: str, cfg: BenchConfig, baselines: bool, progress: Callable[[str], None]) -> dict:
    prev, curr = (ParallelConfig.parse(x) for x in PAPER_SCENARIOS[name])
    progress(f"[{name}] direct migration on {max(prev.world_size, curr.world_size)} processes ...")
    row: dict = {"scenario": name, **run_etc(cfg, prev, curr)}
    row["baselines"] = {}
    if baselines:
        from migrate.baselines import run_baseline

        for kind in ("torch_save", "dcp"):
            progress(f"[{name}] checkpoint baseline {kind} ...")
            with tempfile.TemporaryDirectory(prefix=f"bench-{kind}-", dir=os.environ.get("ELASTIC_BENCH_DIR")) as d:
                res = run_baseline(kind, cfg.model(), prev, curr, tc=cfg.train(), steps_before=1,
                                   workdir=Path(d), port=free_port())
            row["baselines"][kind] = res.total_s
            row.setdefault("baseline_detail", {})[kind] = {"save_s": res.save_s, "restart_s": res.restart_s,
                                                          "load_s": res.load_s, "bit_exact": res.bit_exact}
        fastest = min(row["baselines"].values())
        row["speedup_vs_fastest"] = fastest / row["etc_s"] if row["etc_s"] else None
    else:
        row["speedup_vs_fastest"] = None
    return row
