"""Live mode's steady-state cost on real steps: the share of each step the runtime itself takes.

Jobs under `elastic-launch --backend local` on 2 nodes x 2 devices, no resize: the reference GPT
(`python -m launcher.worker`, pp2dp2), examples/mixer_live.py (a user's script: TP x DP, Adam), and the
same script's --plain training (torch.distributed alone, no runtime) in restart mode, whose step time is
the one live mode is compared with. Each
worker keeps, for the steps no event applied in, every step's wall time and its time in `job.next_step()`
and in the commit vote (launcher.runtime.overhead, $ELASTIC_RUNTIME_STATS); a script in restart mode spends
none of it, so that share is what live mode costs a step over restart mode.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from launcher.runtime.overhead import ENV_RUNTIME_STATS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PLAIN = "examples/mixer_live.py --plain, tp2dp2, restart mode"  # the same training with no runtime


def _jobs(steps: int) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (elastic-launch flags, the program)."""
    jobs = {"reference GPT, pp2dp2": (["--layouts", "pp2dp2"], [
        "-m", "launcher.worker", "--layers", "4", "--hidden", "128", "--vocab", "512", "--log-every", "0",
        "--steps", str(steps)])}
    if (EXAMPLES / "mixer_live.py").exists():  # a checkout: the examples are not installed with the package
        jobs["examples/mixer_live.py, tp2dp2"] = (["--layouts", "tp2dp2"], [str(EXAMPLES / "mixer_live.py"),
                                                                             "--steps", str(steps)])
        # the same training with no runtime in the loop (torch.distributed alone), in restart mode
        jobs[PLAIN] = (["--mode", "restart"], [str(EXAMPLES / "mixer_live.py"), "--plain", "--steps", str(steps)])
    return jobs


def live_over_plain(runs: list[dict]) -> float | None:
    """How much longer mixer_live's median step is in live mode than the same step with no runtime (a share)."""
    by = {r["job"]: r for r in runs if not r.get("error")}
    live, plain = by.get("examples/mixer_live.py, tp2dp2"), by.get(PLAIN)
    if not live or not plain or not plain["step_ms"]:
        return None
    return live["step_ms"] / plain["step_ms"] - 1


def runtime_share(workers: list[dict]) -> dict:
    """Per step (the k-th steady step of every worker): its wall time (the median worker's), the boundary's
    (the median worker's) and the vote's (the smallest: the last rank to vote waits for nobody)."""
    steps = min((len(w["wall_s"]) for w in workers), default=0)
    wall = [statistics.median(w["wall_s"][k] for w in workers) for k in range(steps)]
    boundary = [statistics.median(w["boundary_s"][k] for w in workers) for k in range(steps)]
    vote = [min(w["vote_s"][k] for w in workers) for k in range(steps)]
    total = sum(wall)
    return {"workers": len(workers), "steps": steps, "step_ms": 1000 * statistics.median(wall) if wall else None,
            "boundary_ms": 1000 * statistics.median(boundary) if boundary else None,
            "vote_ms": 1000 * statistics.median(vote) if vote else None,
            "runtime_share": (sum(boundary) + sum(vote)) / total if total else None}


def measure(workdir: Path, steps: int = 200, say=print) -> list[dict]:
    out = []
    for i, (name, (launch, program)) in enumerate(_jobs(steps).items()):
        stats, logs = workdir / f"stats{i}", workdir / f"logs{i}"
        say(f"  {name}: {steps} steps under elastic-launch (local backend, 2 nodes x 2 devices)")
        cmd = [sys.executable, "-m", "launcher.launch", "--backend", "local", "--nnodes", "2", "--gpus-per-node", "2",
               "--db", f"sqlite:///{workdir}/steady{i}.db", "--log-dir", str(logs), "--job-name", f"steady{i}",
               *launch, "--", "python", *program]
        run = subprocess.run(cmd, env={**os.environ, ENV_RUNTIME_STATS: str(stats)}, cwd=workdir,
                             capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            out.append({"job": name, "error": f"elastic-launch exited {run.returncode}: {run.stdout[-400:]}"})
            continue
        out.append({"job": name, **runtime_share([json.loads(p.read_text()) for p in sorted(stats.glob("dev*.json"))]),
                    "error": None})
    return out
