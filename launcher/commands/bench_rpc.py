"""`elastic bench-rpc [--seconds 60]`: what one elastic job in steady training asks of slurmctld.

On the Slurm testbed (this host's release, or `elastic testbed run --slurm 26.05 -- elastic bench-rpc`) an
sbatch job of 2 nodes x 2 GPUs runs `elastic-launch` of the reference GPT with every option at its default,
once with --policy manual and once with --policy opportunistic. Once it trains and its start-up requests are
over (--settle), sdiag's counters are zeroed, and after --seconds they are read: the requests by message
type, per minute. Nothing else runs on the testbed meanwhile; sdiag's own requests are left out.

Why it matters: every launcher of a cluster asks the same slurmctld, and a hundred jobs at 140 requests a
minute each are 14,000; a job should ask a few times a minute (launcher.backends.slurm.nodes.READ_AGE_S).
"""
from __future__ import annotations

import argparse
import os
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from db.vocab import POLICIES
from launcher.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
OWN = ("REQUEST_STATS_INFO",)  # sdiag's own
#: what the testbed's slurmd send by themselves, whatever runs: listed apart, not counted for the job
DAEMONS = ("MESSAGE_NODE_REGISTRATION_STATUS", "REQUEST_NODE_REGISTRATION_STATUS")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60.0, help="how long the requests are counted (default 60)")
    p.add_argument("--settle", type=float, default=45.0,
                   help="seconds of training before counting starts, past the launcher's start-up (default 45)")
    p.add_argument("--workdir", type=Path, default=None, help="where each run's database and logs go "
                                                                 "(default: a temporary folder, kept)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


def job_script(policy: str, workdir: Path) -> str:
    return f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --gres=gpu:2 --job-name=bench-rpc-{policy} --output={workdir}/batch-%j.out --chdir={workdir}
export PYTHONPATH={ROOT}
exec {sys.executable} -m launcher.launch --nnodes 1:2 --gpus-per-node 2 --policy {policy} \\
    --db sqlite:///{workdir}/e.db --log-dir {workdir}/logs \\
    -- python -m launcher.worker --layers 2 --hidden 64 --vocab 256 --log-every 0 --loss-file {workdir}/loss.txt \\
    --steps 100000000 --step-sleep 0.2
"""


def sdiag(env: dict, *args: str) -> str:
    return subprocess.run(["sdiag", *args], env=env, capture_output=True, text=True, check=True).stdout


def measure(policy: str, env: dict, workdir: Path, seconds: float, settle: float, say) -> dict:
    """One job on `policy`: requests per minute by message type while it trains."""
    from launcher.backends.slurm.client import SlurmCommands
    from launcher.backends.slurm.parse import parse_sdiag_rpcs
    from launcher.policybench.replay import read_loss_rows, wait_until

    slurm = SlurmCommands(env=env)
    workdir.mkdir(parents=True, exist_ok=True)
    job = slurm.submit(job_script(policy, workdir))
    try:
        wait_until(f"job {job}'s first steps", lambda: len(read_loss_rows(workdir / "loss.txt")) >= 3, 240)
        say(f"bench-rpc [{policy}]: job {job} trains; {settle:.0f} s to settle, then {seconds:.0f} s counted")
        time.sleep(settle)
        sdiag(env, "-r")
        steps0 = len(read_loss_rows(workdir / "loss.txt"))
        time.sleep(seconds)
        counts = {k: v for k, v in parse_sdiag_rpcs(sdiag(env)).items() if k not in OWN}
        daemons = {k: counts.pop(k) for k in DAEMONS if k in counts}
        steps = len(read_loss_rows(workdir / "loss.txt")) - steps0
        alive = slurm.job_info(job).state == "RUNNING"
    finally:
        slurm.cancel(job)  # and its successor (same name), which a launcher killed before it cancels it would start
        subprocess.run(["scancel", f"--name=bench-rpc-{policy}"], env=env, capture_output=True)
    per_minute = {k: round(v * 60 / seconds, 1) for k, v in sorted(counts.items())}
    return {"policy": policy, "job": job, "seconds": seconds, "steps": steps, "trained_throughout": alive,
            "rpcs_per_minute": round(sum(counts.values()) * 60 / seconds, 1), "by_type": per_minute,
            "slurmd_per_minute": {k: round(v * 60 / seconds, 1) for k, v in daemons.items()}}


def run(args: argparse.Namespace) -> int:
    if not 10 <= args.seconds <= 3600 or args.settle < 0:
        raise UsageError("--seconds from 10 to 3600, --settle not negative")
    from launcher.backends.slurm.client import SlurmCommands
    from launcher.testbed.cluster import Testbed

    say = (lambda msg: print(msg, file=sys.stderr, flush=True))
    testbed = Testbed.brought_up("bench-rpc")
    env = {**os.environ, **testbed.env()}
    major, minor = SlurmCommands(env=testbed.env()).version()
    release = f"{major}.{minor:02d}"
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-rpc-"))
    results = [measure(p, env, workdir / p, args.seconds, args.settle, say) for p in POLICIES]
    for r in results:
        print(f"Slurm {release}, --policy {r['policy']}: {r['rpcs_per_minute']} requests a minute to slurmctld "
              f"({r['steps']} steps in {r['seconds']:.0f} s{'' if r['trained_throughout'] else ', JOB ENDED'})")
        for kind, rate in r["by_type"].items():
            print(f"    {kind:32s} {rate:6.1f}/min")
        for kind, rate in r["slurmd_per_minute"].items():
            print(f"    ({kind} {rate:.1f}/min: the testbed's slurmd, not the job)")
    if args.json:
        print(json.dumps({"slurm": release, "runs": results}))
    return 0
