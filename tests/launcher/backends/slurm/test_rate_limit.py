"""An elastic job of a user whom slurmctld rate-limits (SlurmctldParameters=rl_enable, Slurm 23.02 and later)
keeps training and says it is throttled.

Root is never rate-limited, so the job belongs to a Unix user of its own (made in the root the release runs in),
submitted with `runuser -u USER -- sbatch`. The bucket is small (4 requests, one more every 2 s: 30 a minute;
a site's default is 30 and 2 a second), so the launcher's start-up (job, node and partition reads, one step per node) waits on it: Slurm's client does
not fail a throttled request, it sleeps and asks again, so the answer comes seconds late. Runs on 24.11 and 26.05
(`elastic testbed run --slurm R -- pytest -m slurm`); skipped on 22.05, which has no rl_enable.
"""
from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.testbed.cluster import Testbed
from tests.launcher.conftest import slurm_testbed  # noqa: F401 -- the shared session fixture

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[4]
USER = "elastic-rl"
LIMIT = "rl_bucket_size=4,rl_refill_rate=1,rl_refill_period=2"  # 30 a minute: the launcher's start-up waits on it


def _user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", USER], check=True, capture_output=True)
        return pwd.getpwnam(USER)


@pytest.fixture
def limited(slurm_testbed):  # noqa: F811
    if slurm_testbed.release == "22.05":
        pytest.skip("Slurm 22.05 has no RPC rate limiting (rl_enable came with 23.02)")
    testbed = Testbed(slurm_testbed.root, rpc_limit=LIMIT)
    testbed.up()
    try:
        yield testbed
    finally:
        slurm_testbed.up()


def test_a_rate_limited_users_job_keeps_training_and_says_so(limited, tmp_path_factory) -> None:
    user = _user()
    work = Path(f"/tmp/elastic-rl-{os.getpid()}")
    work.mkdir(exist_ok=True)
    os.chown(work, user.pw_uid, user.pw_gid)
    script = f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --gres=gpu:2 --job-name=rate-limited --output={work}/batch.out --chdir={work}
export PYTHONPATH={ROOT}
exec {sys.executable} -m launcher.launch --nnodes 1:2 --gpus-per-node 2 --db sqlite:///{work}/e.db \\
    --log-dir {work}/logs -- python -m launcher.worker --layers 2 --hidden 64 --vocab 256 --log-every 0 \\
    --loss-file {work}/loss.txt --steps 100000000 --step-sleep 0.2
"""
    (work / "job.sh").write_text(script)
    env = {**os.environ, **limited.env(), "HOME": user.pw_dir}
    out = subprocess.run(["runuser", "-u", USER, "--", "sbatch", "--parsable", str(work / "job.sh")], env=env,
                         capture_output=True, text=True, check=True, timeout=120)
    job = out.stdout.strip().split(";")[0]

    def steps() -> int:
        path = work / "loss.txt"
        return len(path.read_text().splitlines()) if path.exists() else 0

    try:
        deadline = time.monotonic() + 240
        while steps() < 5 and time.monotonic() < deadline:
            time.sleep(1)
        assert steps() >= 5, (work / "batch.out").read_text() if (work / "batch.out").exists() else "no output"
        before = steps()
        time.sleep(40)  # the launcher's routine looks go on, throttled
        state = subprocess.run(["squeue", "-h", "-o", "%T", "-j", job], env=env, capture_output=True,
                               text=True).stdout.strip()
        assert state == "RUNNING" and steps() > before + 20, (state, before, steps())
        said = (work / "batch.out").read_text()
        assert "slurmctld took" in said and "training goes on" in said, said[-3000:]
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True)
