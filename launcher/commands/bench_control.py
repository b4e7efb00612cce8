"""`elastic bench-control`: live mode's per-step control-plane cost at N ranks (launcher.controlbench)."""
from __future__ import annotations

import argparse
import json
import sys

from launcher.errors import UsageError

MAX_RANKS = 8192


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=1024,
                   help="simulated ranks on the store (default 1024; up to 4096 runs on 2 cores and 24 GiB)")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="how long rank 0 steps back to back with no compute (default 10)")
    p.add_argument("--groups", default="2,4,8",
                   help="sizes of the real gloo process groups the vote's messages are measured on (default 2,4,8)")
    p.add_argument("--processes", type=int, default=8, help="processes the simulated ranks are threads of (default 8)")
    p.add_argument("--steady", type=int, default=0, metavar="STEPS",
                   help="also run the reference GPT and examples/mixer_live.py this many steps on 2 nodes x 2 "
                        "devices (local backend), report the share of each step the runtime takes, and time "
                        "mixer_live's step against the same step with no runtime (--plain, restart mode) "
                        "(default: not)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--groups {text!r}: give process counts separated by commas, e.g. 2,4,8") from None
    if not sizes or sizes[0] < 2 or sizes[-1] > 64:
        raise UsageError(f"--groups {text!r}: sizes from 2 to 64 (the smallest, 2, gives the per-hop time)")
    if sizes[0] != 2:
        sizes.insert(0, 2)
    return sizes


def run(args: argparse.Namespace) -> int:
    if not 2 <= args.ranks <= MAX_RANKS:
        raise UsageError(f"--ranks {args.ranks}: from 2 to {MAX_RANKS}")
    if args.steady < 0:
        raise UsageError("--steady: a number of steps (0: not run)")
    if args.seconds < 2:
        raise UsageError("--seconds: at least 2 (events are posted one at a time while rank 0 steps)")
    sizes = _sizes(args.groups)
    from launcher.controlbench import groups, store_share
    from launcher.controlbench.report import combine, describe

    say = (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"bench-control: the store's share at {args.ranks} simulated ranks ({args.processes} processes of threads, "
        f"{args.seconds:.0f} s of steps)")
    store = store_share.measure(args.ranks, seconds=args.seconds, processes=args.processes, say=say)
    measured = []
    for n in sizes:
        say(f"bench-control: the vote's messages on a real gloo process group of {n} processes")
        measured.append(groups.measure(n, seconds=min(args.seconds, 5.0)))
    out = combine(store, measured)
    if args.steady:
        import tempfile
        from pathlib import Path

        from launcher.controlbench import steady

        say("bench-control: live mode's steady-state cost on real steps")
        with tempfile.TemporaryDirectory(prefix="elastic-steady-") as tmp:
            out["steady"] = steady.measure(Path(tmp), args.steady, say)
        out["live_over_plain"] = steady.live_over_plain(out["steady"])
    print(json.dumps(out, indent=1) if args.json else describe(out))
    return 0
