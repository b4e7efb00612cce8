"""`elastic bench-plan`: how long planning takes, from 8 devices to 16,384."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

SCENARIOS = [  # (from, to, failed devices): PP x TP from 8 to 64 ranks, then the 16,384-device job
    ("pp4tp2", "pp2tp4", ()), ("pp4tp4", "pp8tp2", ()), ("pp4tp2", "pp6tp4", ()), ("pp8tp4", "pp4tp8", ()),
    ("pp8tp8", "pp4tp8", ()), ("pp6tp4", "pp8tp8", ()),
    ("pp16tp8dp128", "pp16tp8dp127", (5,)), ("pp16tp8dp128", "pp8tp8dp256", ()),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=96, help="transformer layers (default 96)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--placement", choices=["resilient", "packed"], default="packed",
                   help="placement rule the planner works under (default packed)")
    p.add_argument("--repeat", type=int, default=5, help="runs per scenario; the median is reported")
    p.add_argument("--json", action="store_true")


def _median_ms(fn, repeat: int) -> tuple[float, float, object]:
    times, out = [], None
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), max(times), out


def run(args: argparse.Namespace) -> int:
    from migrate import ModelSpec, ParallelConfig, Topology, plan

    model = ModelSpec(layers=args.layers, hidden=args.hidden, vocab=32768)
    rows = []
    for src, dst, failed in SCENARIOS:
        prev, curr = ParallelConfig.parse(src), ParallelConfig.parse(dst)
        nodes = math.ceil(max(prev.world_size, curr.world_size) / args.gpus_per_node)
        topo = Topology.grid(nodes, args.gpus_per_node)
        med, worst, p = _median_ms(lambda: plan(model, prev, curr, topo, frozenset(failed), placement=args.placement),
                                   args.repeat)
        # what one worker does with the plan: expand its own instructions (device 1: sends and receives)
        dev = p.curr.devices[min(1, len(p.curr.devices) - 1)]
        posted = p.to_dict(instructions=False)  # what the launcher posts (no instruction list)
        worker_ms, _, mine = _median_ms(lambda: type(p).from_dict(posted).instructions_for(dev), args.repeat)
        rows.append({"from": src, "to": dst, "failed": list(failed), "devices": max(prev.world_size, curr.world_size),
                     "plan_ms_median": round(med, 3), "plan_ms_max": round(worst, 3),
                     "worker_expand_ms_median": round(worker_ms, 3), "worker_instructions": len(mine),
                     "optimal": p.optimal, "bytes_moved": p.bytes_moved, "bytes_lower_bound": p.bytes_lower_bound,
                     "bytes_lower_bound_no_rule": p.bytes_lower_bound_no_rule})
        if not args.json:
            r = rows[-1]
            fail = f" failed {','.join(map(str, failed))}" if failed else ""
            print(f"{src:>14s} -> {dst:<14s}{fail:10s} {r['devices']:6d} devices  plan {r['plan_ms_median']:8.2f} ms "
                  f"(max {r['plan_ms_max']:.2f})  one worker's instructions {r['worker_expand_ms_median']:7.2f} ms "
                  f"({r['worker_instructions']})  {'optimal' if r['optimal'] else 'NOT proven optimal'}", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0
