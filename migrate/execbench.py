"""The execute phase alone, both engines, against the loopback ceiling: `python -m migrate.execbench`.

`elastic bench` (launcher.bench) measures the whole pause through the launcher; this isolates the
transfer: one forked process per device (gloo over loopback, no torch import per process), each
holding its old shard of a paper scenario's state (cheap deterministic values, no training), moves
it with the reference GPT executor (migrate.executor) or the manifest engine (migrate.reshard, with
the GPT's manifests), and checks every new piece element for element against the values it must
hold. Reported per scenario and engine: the slowest process's transfer time, the bytes that crossed
between processes, GB/s, the ceiling (migrate.bench.loopback_ceiling with as many processes), the CPU
seconds of all processes together (what the shared cores paid; steadier than wall time when other
work runs on the machine), and the
peak resident memory over the resident memory before the migration of the busiest process that held
old state.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib

import torch
import torch.distributed as dist

from migrate.bench import BenchConfig, loopback_ceiling, run_forked
from migrate.layout import ParallelConfig
from migrate.plan import plan
from migrate.scenarios import PAPER_SCENARIOS
from migrate.state import LocalState, local_shape, shard_range
from migrate.workload import held_tensors, rank_workload
from migrate.topology import Topology


def _full(kind: str, name: str, shape) -> torch.Tensor:
    """The whole tensor's values: a cheap function of (kind, name, element index)."""
    n = math.prod(shape)
    base = zlib.crc32(f"{kind}.{name}".encode()) % 997
    return (torch.arange(n, dtype=torch.int32) % 65521).to(torch.float32).mul_(1e-3).add_(base).view(shape)


def _shard(model, cfg: ParallelConfig, rank: int, units: int) -> dict[tuple[str, str], torch.Tensor]:
    w = rank_workload(cfg, rank, model.layers, units)
    out = {}
    for spec in held_tensors(model, w):
        for kind in model.state_kinds:
            t = _full(kind, spec.name, spec.shape)
            if spec.tp_dim is not None:
                t = t.narrow(spec.tp_dim, *shard_range(spec, w))
            out[(kind, spec.name)] = t.contiguous()
    return out


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _profiler(device: int):
    """EXECBENCH_PROFILE=<device>: profile that device's transfer (printed to stderr)."""
    import os

    if os.environ.get("EXECBENCH_PROFILE") != str(device):
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _dump(prof, device: int) -> None:
    import os

    if prof is None:
        return
    import pstats

    prof.disable()
    print(f"-- profile of device {device}", file=sys.stderr)
    pstats.Stats(prof, stream=sys.stderr).sort_stats(os.environ.get("EXECBENCH_SORT", "cumulative")).print_stats(25)


def _once(device: int, job: dict, profile: bool):
    """One transfer of this device's part; (seconds, new pieces by (kind, name), RSS before, peak RSS)."""
    p, engine, release = job["plan"], job["engine"], job["release_early"]
    model, units = p.model, p.units
    old_rank, new_rank = p.prev.rank_of().get(device), p.curr.rank_of().get(device)
    old = _shard(model, p.prev.layout, old_rank, units) if old_rank is not None else {}
    rss_start = _rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if engine == "executor":
        from migrate.executor import DeviceExecutor, prepare_targets

        state = LocalState({k: {} for k in model.state_kinds})
        for (kind, name), t in old.items():
            state.tensors[kind][name] = t
        old = None
        targets = prepare_targets(p, device, release)
        run = lambda: DeviceExecutor(p, device, state if old_rank is not None else None, None,  # noqa: E731
                                     job["window"], None, release, targets).run()
    else:
        from migrate.reshard import (allocate_staging, allocate_targets, execute, plan_local, plan_staging,
                                     plan_targets, prepare_transfer)

        local = {f"{k}.{name}": t for (k, name), t in old.items()}
        old = None
        old_ms, new_ms, transfers = job["manifests"]
        om = old_ms[old_rank] if old_rank is not None else None
        nm = new_ms[new_rank] if new_rank is not None else None
        # targets, staging, this process's part and its transfer made ahead (before the pause in a real migration),
        # as a worker
        targets = allocate_targets(plan_targets(transfers, old_rank, new_rank, om, nm, release))
        staging = allocate_staging(plan_staging(transfers, old_rank, new_rank, om, nm, release))
        part = plan_local(transfers, old_rank, new_rank, om, nm)
        ready = prepare_transfer(transfers, old_rank, new_rank, local, om, nm, release, targets=targets,
                                 verify=job["verify"], staging=staging, local=part)
        run = lambda: execute(transfers, old_rank, new_rank, local, om, nm,  # noqa: E731
                              list(p.prev.devices), list(p.curr.devices), release_early=release,
                              targets=targets, verify=job["verify"], staging=staging, local=part, prepared=ready)
    dist.barrier()
    prof = _profiler(device) if profile else None
    t0, c0 = time.perf_counter(), time.process_time()
    out = run()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    _dump(prof, device)
    peak = _rss("VmHWM:")
    if engine == "executor":
        got = {(k, name): t for k, per in (out.state.tensors.items() if out.state else ()) for name, t in per.items()}
    else:
        got = {tuple(f.split(".", 1)): t for f, t in out.items()}
    return elapsed, got, rss_start, peak, cpu


def _exact(p, new_rank: int | None, got: dict) -> bool:
    """Every new piece holds exactly the values cut from the whole tensors, and nothing is missing."""
    if new_rank is None:
        return not got
    model, units = p.model, p.units
    w = rank_workload(p.curr.layout, new_rank, model.layers, units)
    specs = {s.name: s for s in held_tensors(model, w)}
    exact = set(got) == {(k, name) for name in specs for k in model.state_kinds}
    for (kind, name), t in got.items():
        spec = specs[name]
        full = _full(kind, name, spec.shape)
        if spec.tp_dim is not None:
            full = full.narrow(spec.tp_dim, *shard_range(spec, w))
        exact = exact and tuple(t.shape) == local_shape(spec, w) and torch.equal(t, full)
    return exact


def _worker(device: int, n: int, port: int, job: dict, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=device, world_size=n)
    times, cpus, exact, mem = [], [], True, None
    for rep in range(job["repeat"]):
        elapsed, got, rss_start, peak, cpu = _once(device, job, rep == job["repeat"] - 1)
        times.append(elapsed)
        cpus.append(cpu)
        mem = mem or (rss_start, peak)  # memory of the first transfer, from a fresh process
        dist.barrier()
        exact = exact and _exact(job["plan"], job["plan"].curr.rank_of().get(device), got)
        del got
    queue.put((device, times, exact, *mem, cpus))
    dist.barrier()
    dist.destroy_process_group()


def run_one(name: str, engine: str, cfg: BenchConfig, release_early: bool, window: int | None = None,
            repeat: int = 3, verify: bool = True) -> dict:
    """One scenario moved by one engine in forked processes; the row `python -m migrate.execbench` prints."""
    prev, curr = (ParallelConfig.parse(x) for x in PAPER_SCENARIOS[name])
    n = max(prev.world_size, curr.world_size)
    model = cfg.model()
    p = plan(model, prev, curr, Topology.grid(math.ceil(n / cfg.gpus_per_node), cfg.gpus_per_node), frozenset())
    job = {"plan": p, "engine": engine, "release_early": release_early, "window": window, "repeat": repeat,
           "verify": verify}
    if engine == "manifest":
        from migrate.manifest import gpt_manifest
        from migrate.reshard import plan_transfers

        old_ms = [gpt_manifest(model, p.prev.layout, r) for r in range(prev.world_size)]
        new_ms = [gpt_manifest(model, p.curr.layout, r) for r in range(curr.world_size)]
        old_of = p.prev.rank_of()
        same = {r: old_of[d] for r, d in enumerate(p.curr.devices) if d in old_of}
        job["manifests"] = (old_ms, new_ms, plan_transfers(old_ms, new_ms, same))
    rows = run_forked(_worker, n, (job,), n, timeout=600)
    slowest = min(max(r[1][i] for r in rows) for i in range(repeat))  # best of the repeats
    # CPU seconds of all processes together (gloo's threads included): what 2 shared cores pay, and far
    # less sensitive to other load than wall time
    cpu = min(sum(r[5][i] for r in rows) for i in range(repeat))
    # over the processes that held old state (a joiner's ratio is its received state over a bare process)
    old_of = p.prev.rank_of()
    busiest = max((r for r in rows if r[0] in old_of), key=lambda r: r[4] / max(r[3], 1))
    return {"scenario": name, "engine": engine, "release_early": release_early, "processes": n,
            "bytes_moved": p.bytes_moved, "execute_s": round(slowest, 4),
            "execute_gbps": round(p.bytes_moved / slowest / 1e9, 3), "cpu_s": round(cpu, 3),
            "bit_exact": all(r[2] for r in rows),
            "peak_over_start": round(busiest[4] / busiest[3], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m migrate.execbench", description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", action="append", choices=sorted(PAPER_SCENARIOS))
    ap.add_argument("--engine", action="append", choices=["executor", "manifest"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--release-early", action="store_true")
    ap.add_argument("--window", type=int, default=None, help="window bytes (default: the engine's)")
    ap.add_argument("--repeat", type=int, default=3, help="transfers per scenario and engine; the best counts")
    ap.add_argument("--no-verify", action="store_true", help="manifest engine: skip the digest comparison")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cfg = BenchConfig(layers=args.layers, hidden=args.hidden)
    names = args.scenario or list(PAPER_SCENARIOS)
    ceilings: dict[int, float] = {}
    rows = []
    for name in names:
        n = max(ParallelConfig.parse(x).world_size for x in PAPER_SCENARIOS[name])
        if n not in ceilings:
            ceilings[n] = loopback_ceiling(n)
        for engine in args.engine or ["executor", "manifest"]:
            row = run_one(name, engine, cfg, args.release_early, args.window, args.repeat, not args.no_verify)
            row["ceiling_gbps"] = round(ceilings[n] / 1e9, 3)
            row["share_of_ceiling"] = round(row["execute_gbps"] / row["ceiling_gbps"], 3)
            print(json.dumps(row) if args.json else
                  f"{name:22s} {engine:8s} {row['bytes_moved'] / 1e6:8.1f} MB {row['execute_s']:7.3f} s "
                  f"{row['execute_gbps']:6.2f} GB/s of {row['ceiling_gbps']:.2f} ({row['share_of_ceiling']:.0%}) "
                  f"cpu {row['cpu_s']:6.3f} s "
                  f"peak/start {row['peak_over_start']:.2f} bit-exact {row['bit_exact']}", flush=True)
            rows.append(row)
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
