"""`elastic bench-plan`: how long planning takes, from 8 devices to 16,384."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

SCENARIOS = [  # (from, to): PP x TP from 8 to 64 ranks, then the 16,384-device job
    ("pp4tp2", "pp2tp4"), ("pp4tp4", "pp8tp2"), ("pp4tp2", "pp6tp4"), ("pp8tp4", "pp4tp8"),
    ("pp8tp8", "pp4tp8"), ("pp6tp4", "pp8tp8"), ("pp16tp8dp128", "pp16tp8dp96"), ("pp16tp8dp128", "pp8tp8dp256"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=96, help="transformer layers (default 96)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5, help="runs per scenario; the median is reported")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from migrate import ModelSpec, ParallelConfig, Topology, plan

    model = ModelSpec(layers=args.layers, hidden=args.hidden, vocab=32768)
    rows = []
    for src, dst in SCENARIOS:
        prev, curr = ParallelConfig.parse(src), ParallelConfig.parse(dst)
        nodes = math.ceil(max(prev.world_size, curr.world_size) / args.gpus_per_node)
        topo = Topology.grid(nodes, args.gpus_per_node)
        times = []
        for _ in range(max(1, args.repeat)):
            t0 = time.perf_counter()
            p = plan(model, prev, curr, topo)
            times.append((time.perf_counter() - t0) * 1000)
        rows.append({"from": src, "to": dst, "devices": max(prev.world_size, curr.world_size),
                     "plan_ms_median": round(statistics.median(times), 3), "plan_ms_max": round(max(times), 3),
                     "instructions": len(p.instructions), "bytes_moved": p.bytes_moved})
        if not args.json:
            r = rows[-1]
            print(f"{src:>14s} -> {dst:<14s} {r['devices']:6d} devices  plan {r['plan_ms_median']:9.2f} ms "
                  f"(max {r['plan_ms_max']:.2f})  {r['instructions']:7d} instructions", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0
