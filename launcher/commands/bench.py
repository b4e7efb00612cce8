"""`elastic bench`: direct migration vs. checkpoint restarts on the paper's six reconfigurations."""
from __future__ import annotations

import argparse
import json
import sys

from launcher.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from migrate.bench import PAPER_SCENARIOS

    p.add_argument("--scenario", action="append", choices=sorted(PAPER_SCENARIOS), metavar="NAME",
                   help=f"run only this scenario (repeatable): {', '.join(PAPER_SCENARIOS)}")
    p.add_argument("--layers", type=int, default=48, help="transformer layers (default 48; must divide by 16 and 6)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default 512, 8 heads)")
    p.add_argument("--no-baselines", action="store_true", help="skip the checkpoint baselines (much faster)")
    p.add_argument("--release-early", action="store_true",
                   help="free each old tensor after its last send (lower peak memory; a failure half way then "
                        "needs replicas or a checkpoint instead of the old layout)")
    p.add_argument("--json", action="store_true", help="print one JSON list at the end")


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def run(args: argparse.Namespace) -> int:
    from migrate import LayoutError, ParallelConfig
    from migrate.bench import PAPER_SCENARIOS, BenchConfig, p2p_bandwidth, run_scenario_bench

    cfg = BenchConfig(layers=args.layers, hidden=args.hidden, release_early=args.release_early)
    try:
        model = cfg.model()
        for name in args.scenario or PAPER_SCENARIOS:
            for layout in PAPER_SCENARIOS[name]:
                model.check_config(ParallelConfig.parse(layout))
    except LayoutError as exc:
        raise UsageError(f"{exc} (pick --layers divisible by 16 and 6, --hidden divisible by 8x64)") from None

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    progress(f"model: {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}: "
             f"{_gb(model.state_bytes)} of params + Adam moments (fp32). The paper's models are far larger; "
             "this machine has 2 cores and 24 GiB, so sizes are scaled down and every device is a process.")
    progress("measuring point-to-point bandwidth (2 processes, batch_isend_irecv) ...")
    p2p = p2p_bandwidth()
    rows = []
    for name in args.scenario or PAPER_SCENARIOS:
        row = run_scenario_bench(name, cfg, not args.no_baselines, progress)
        row["p2p_bytes_per_s"] = p2p
        rows.append(row)
        b = row["baselines"]
        base = (f"torch.save {b['torch_save']:.2f}s  dcp {b['dcp']:.2f}s  speedup {row['speedup_vs_fastest']:.1f}x"
                if b else "baselines skipped")
        progress(f"[{name}] ETC {row['etc_s']:.3f}s  ({', '.join(f'{k} {v:.3f}' for k, v in row['phases'].items())})  "
                 f"{base}  moved {_gb(row['bytes_moved'])}  execute {row['execute_bytes_per_s'] / 1e9:.2f} GB/s "
                 f"({100 * row['execute_bytes_per_s'] / p2p:.0f}% of p2p {p2p / 1e9:.2f} GB/s)  "
                 f"peak mem {row['peak_mem_ratio']:.2f}x  bit-exact {row['bit_exact']}")
    if args.json:
        print(json.dumps([{k: r[k] for k in ("scenario", "etc_s", "baselines", "speedup_vs_fastest", "bytes_moved",
                                             "peak_mem_ratio", "bit_exact", "phases", "execute_bytes_per_s",
                                             "p2p_bytes_per_s")} for r in rows]))
    return 0 if all(r["bit_exact"] for r in rows) else 1
