"""Capture what a real Slurm prints, as golden files for the parsers' tests.

    elastic testbed up --slurm R
    elastic testbed run --slurm R -- .venv/bin/python scripts/capture-slurm-output.py

On the testbed of release R (the host's 22.05 without --slurm) this runs a plain 2-node job with
GPUs, a heterogeneous job and a job that must wait, then writes what `squeue --json`, `sinfo --json`
(plain and in the named format the launcher asks for) and `scontrol show -d job` print into
tests/launcher/golden/slurm/R/ (R from `scontrol --version`). The jobs are cancelled afterwards.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "launcher" / "golden" / "slurm"


def sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        sys.exit(f"capture: `{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def submit(*args: str) -> int:
    return int(sh("sbatch", "--parsable", "--output=/dev/null", *args).strip().split(";")[0])


def wait_running(job: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "JobState=RUNNING" in sh("scontrol", "show", "job", str(job)):
            return
        time.sleep(0.3)
    sys.exit(f"capture: job {job} did not start in {timeout:.0f} s")


def main() -> int:
    release = ".".join(re.search(r"(\d+)\.(\d+)", sh("scontrol", "--version")).groups())
    out = GOLDEN / release
    out.mkdir(parents=True, exist_ok=True)
    plain = submit("--job-name=capture-plain", "--nodes=2", "--ntasks-per-node=2", "--gres=gpu:2",
                   "--wrap=sleep 300")
    wait_running(plain)
    het = submit("--job-name=capture-het", "--nodes=1", "--gres=gpu:1", ":", "--nodes=1", "--gres=gpu:3",
                 "--wrap=sleep 300")
    wait_running(het)
    waiting = submit("--job-name=capture-pending", "--nodes=4", "--exclusive", "--comment=elastic:waits",
                     "--wrap=sleep 300")
    time.sleep(1.5)
    try:
        files = {
            "squeue.json": sh("squeue", "--json"),
            "sinfo.json": sh("sinfo", "--json"),
            "show_job_plain.txt": sh("scontrol", "show", "-d", "job", str(plain)),
            "show_job_het.txt": sh("scontrol", "show", "-d", "job", str(het)),
            "show_job_pending.txt": sh("scontrol", "show", "-d", "job", str(waiting)),
            "version.txt": sh("scontrol", "--version"),
        }
        formats = subprocess.run(["squeue", "--json=list"], capture_output=True, text=True).stdout
        named = sorted(set(re.findall(r"data_parser/(v[\d.]+)", formats)))
        for fmt in named:
            files[f"squeue-{fmt}.json"] = sh("squeue", f"--json={fmt}")
            files[f"sinfo-{fmt}.json"] = sh("sinfo", f"--json={fmt}")
        files["jobs.json"] = json.dumps({"plain": plain, "het": het, "pending": waiting}) + "\n"
        for name, text in files.items():
            (out / name).write_text(text)
        print(f"capture: Slurm {release}: {len(files)} files in {out}")
    finally:
        subprocess.run(["scancel", str(plain), str(het), str(waiting)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
