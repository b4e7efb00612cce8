"""`elastic bench`: the paper's six reconfigurations, each resized live and by checkpoint restart
through the real launcher (local backend), measured as the pause training sees."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from launcher.errors import UsageError


class _ScenarioNames:
    """The paper's scenario names as argparse `choices`, looked up only when a `--scenario` is given or the
    help is printed: the migrate package imports numpy and scipy (~1 s), which every other `elastic` command
    would pay while `elastic`'s parser is built. migrate.scenarios needs no torch."""

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())

    @staticmethod
    def _names() -> list[str]:
        from migrate.scenarios import PAPER_SCENARIOS

        return list(PAPER_SCENARIOS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", action="append", choices=_ScenarioNames(), metavar="NAME",
                   help="run only this scenario (repeatable): %(choices)s")
    p.add_argument("--layers", type=int, default=48, help="transformer layers (default 48; must divide by 16 and 6)")
    p.add_argument("--hidden", type=int, default=None,
                   help="hidden size, 8 heads (default: the largest of 512, 384, 256, 128 whose every scenario "
                        "fits in 3/4 of this machine's available memory)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the checkpoint-restart resize (restart_pause_s and speedup are then null)")
    p.add_argument("--release-early", action="store_true",
                   help="free each old tensor after its last send (lower peak memory; a failure half way then "
                        "needs replicas or a checkpoint instead of the old layout)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="worker logs, the bench database and checkpoints (default: a temporary folder, removed)")
    p.add_argument("--json", action="store_true", help="print one JSON list at the end, one object per scenario")
    p.add_argument("--explain", action="store_true",
                   help="print where each live pause went: every worker's marks from the old layout's last "
                        "committed step to the new one's first, and the critical path (also in --json as "
                        "pause_breakdown)")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from launcher.bench import run_bench
    from migrate import LayoutError, ParallelConfig
    from migrate.bench import BenchConfig, estimated_peak_bytes, fit_hidden, mem_available
    from migrate.scenarios import PAPER_SCENARIOS

    names = args.scenario or list(PAPER_SCENARIOS)
    cfg = BenchConfig(layers=args.layers, release_early=args.release_early)
    budget = mem_available() * 3 // 4
    if args.hidden is not None:
        cfg = replace(cfg, hidden=args.hidden)
    else:
        found = fit_hidden(cfg, names, budget)
        if found is None:
            raise UsageError(f"no model size fits in {budget / 2**30:.1f} GiB for these scenarios; "
                             "free memory or run fewer (--scenario)")
        cfg = found
    try:
        model = cfg.model()
        for name in names:
            for layout in PAPER_SCENARIOS[name]:
                model.check_config(ParallelConfig.parse(layout))
    except LayoutError as exc:
        raise UsageError(f"{exc} (pick --layers divisible by 16 and 6, --hidden divisible by 8)") from None

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    need = max(estimated_peak_bytes(model, *map(ParallelConfig.parse, PAPER_SCENARIOS[n])) for n in names)
    progress(f"model: {cfg.layers} layers, hidden {cfg.hidden}, 8 heads, vocab {cfg.vocab}, global batch "
             f"{cfg.global_batch}: {model.state_bytes / 1e9:.2f} GB of params + Adam moments (fp32) per replica; "
             f"estimated peak {need / 2**30:.1f} GiB of {budget / 2**30:.1f} GiB allowed (3/4 of what is available). "
             "Every device is a worker process on this machine.")
    if args.workdir is not None:
        rows = run_bench(names, cfg, args.workdir.resolve(), not args.no_baselines, progress, args.explain)
    else:
        with tempfile.TemporaryDirectory(prefix="elastic-bench-") as d:
            rows = run_bench(names, cfg, Path(d), not args.no_baselines, progress, args.explain)
    for r in rows:
        if r["error"]:
            progress(f"[{r['scenario']}] ERROR {r['error']}")
            continue
        speed = f"{r['speedup']:.1f}x" if r["speedup"] else "-"
        restart = f"{r['restart_pause_s']:.2f}s" if r["restart_pause_s"] is not None else "-"
        execute = (f"{r['execute_gbps']:.2f} GB/s of {r['ceiling_gbps']:.2f}"
                   if r["execute_gbps"] is not None else "-")
        progress(f"[{r['scenario']}] pause {r['pause_s']:.2f}s  restart {restart}  speedup {speed}  "
                 f"moved {r['bytes_moved'] / 1e9:.2f} GB  execute {execute}  peak mem {r['peak_mem_ratio']:.2f}x  "
                 f"bit-exact {r['bit_exact']}  phases {r['phases']}")
    if args.json:
        print(json.dumps(rows))
    return 0 if all(r["error"] is None and r["bit_exact"] for r in rows) else 1
