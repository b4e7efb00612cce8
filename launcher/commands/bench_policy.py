"""`elastic bench-policy`: a scripted stretch of plain jobs on the Slurm testbed, with an elastic job on --policy
manual and then on --policy opportunistic (launcher.policybench): cluster utilisation, the plain jobs' waits,
the elastic job's steps, the policy's resizes."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from db.vocab import POLICIES
from launcher.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=1, help="the trace's seed: arrivals, sizes, run times (default 1)")
    p.add_argument("--seconds", type=float, default=240.0,
                   help="how long plain jobs keep arriving (default 240: a compressed day); each run lasts this "
                        "plus the last jobs' end, plus about a minute to start and stop the elastic job")
    p.add_argument("--policy-idle", type=float, default=5.0,
                   help="the elastic job's --policy-idle, scaled to the compressed trace (default 5)")
    p.add_argument("--policy-dwell", type=float, default=10.0,
                   help="its --policy-dwell, scaled the same way (default 10)")
    p.add_argument("--workdir", type=Path, default=None, help="where each run's database and logs go (default: a "
                                                                 "temporary folder, kept)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


def run(args: argparse.Namespace) -> int:
    if not 60 <= args.seconds <= 7200:
        raise UsageError(f"--seconds {args.seconds:g}: from 60 to 7200")
    if args.policy_idle < 0 or args.policy_dwell < 0:
        raise UsageError("--policy-idle and --policy-dwell: seconds, not negative")
    from launcher.policybench.replay import Knobs, run_policy
    from launcher.policybench.report import describe, goals
    from launcher.policybench.trace import make_trace
    from launcher.testbed.cluster import Testbed

    say = (lambda msg: print(msg, file=sys.stderr, flush=True))
    testbed = Testbed.brought_up("bench-policy")
    total = len(testbed.nodes)
    trace = make_trace(args.seed, args.seconds, max_nodes=total - 1)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-policy-"))
    knobs = Knobs(idle_s=args.policy_idle, dwell_s=args.policy_dwell)
    say(f"bench-policy: {len(trace)} plain jobs (seed {args.seed}) over {args.seconds:.0f} s on {total} nodes; "
        f"runs in {workdir}")
    runs = [run_policy(p, trace, args.seconds, testbed.env(), workdir / p, knobs, total, say) for p in POLICIES]
    met = goals(*runs)
    for line in describe(runs):
        print(line)
    for goal, ok in met.items():
        print(f"  {'met' if ok else 'MISSED'}: {goal}")
    if args.json:
        print(json.dumps({"seed": args.seed, "seconds": args.seconds, "nodes": total,
                          "trace": [vars(j) for j in trace], "runs": [r.as_dict() for r in runs], "goals": met},
                         default=str))
    return 0 if all(r.error is None for r in runs) else 1
