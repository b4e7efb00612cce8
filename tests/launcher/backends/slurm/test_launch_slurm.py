"""elastic-launch on the real 4-node Slurm testbed: sbatch a job across 4 nodes, shrink it to 2
with `elastic resize`, check Slurm and the history, then USR1 suspends it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from db import Store
from launcher.cli import main as elastic
from launcher.backends.slurm.client import SlurmCommands
from launcher.policybench.replay import wait_until

pytestmark = pytest.mark.slurm
from tests.paths import ROOT


def wait(what, fn, timeout=120.0, every=0.2):
    """Poll `fn` every `every` s until it returns something true (returned), else fail after `timeout` s.
    (0.2 s, not 0.5: the Slurm tests wait ~35 times each run, and half a poll interval is lost per wait.)"""
    try:
        return wait_until(what, fn, timeout, every)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def test_shrink_by_resize_then_usr1_suspends(slurm_testbed, tmp_path):
    env = slurm_testbed.env()
    slurm = SlurmCommands(env=env)
    url = f"sqlite:///{tmp_path}/e.db"
    script = f"""#!/bin/bash
#SBATCH --nodes=4 --ntasks-per-node=2 --gres=gpu:2 --job-name=elastic-it --output={tmp_path}/batch.out --chdir={tmp_path}
export PYTHONPATH={ROOT}  # scontrol update writes slurm_job_N_resize.* into the cwd: keep them in tmp
exec {sys.executable} -m launcher.launch --nnodes 2:4 --gpus-per-node 2 --layouts pp4tp2,pp2tp2 \\
    --on-signal suspend --db {url} --log-dir {tmp_path}/logs \\
    -- python -m launcher.worker --layers 4 --hidden 128 --vocab 512 --step-sleep 0.05 --log-every 0
"""
    # the tests before this one (in this folder: faults, het jobs) cancel their jobs at their end, and Slurm may
    # still be ending their steps: start on an idle testbed, not 60 s into a queue wait
    wait("the testbed idle", lambda: not subprocess.run(["squeue", "--noheader"], env={**os.environ, **env},
                                                        capture_output=True, text=True).stdout.strip(), timeout=180)
    job_id = slurm.submit(script)
    try:
        store = wait("the job in the database", lambda: _open(url), timeout=60)
        job = wait("job registered", lambda: store.find_job("elastic-it"), timeout=180)
        assert job.slurm_job_id == str(job_id)
        # the job is registered from the first second; its rank map once the workers are placed
        first = wait("first rank map", lambda: store.current_rank_map(job.id), timeout=180)
        assert first.layout == "pp4tp2dp1" and len({e.node for e in first.entries}) == 4
        wait("training", lambda: _log_has(tmp_path / "batch.out", "job ") and True, timeout=30)
        time.sleep(3)
        assert elastic(["resize", "elastic-it", "--nodes", "2", "--db", url]) == 0
        req = wait("the resize carried out", lambda: [r for r in store.list_requests(job.id) if r.status != "pending"],
                   timeout=180)[0]
        assert req.status == "done", req.message
        info = slurm.job_info(job_id)
        assert info.state == "RUNNING" and info.num_nodes == 2 and len(info.nodes) == 2
        assert info.batch_host in info.nodes
        out = subprocess.run(["squeue", "--noheader", "-o", "%D", "-j", str(job_id)], env={**os.environ, **env},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == "2"
        current = store.current_rank_map(job.id)
        assert current.layout == "pp2tp2dp1" and {e.node for e in current.entries} == set(info.nodes)
        (mig,) = store.recent_migrations(job.id)
        assert mig.status == "succeeded" and mig.trigger == "resize" and mig.bit_exact is True
        assert set(mig.phases) == {"plan", "build_groups", "execute", "rebuild", "other"}
        assert mig.bytes_moved > 0
        released = {n.name for n in store.list_nodes(job.id) if n.state == "released"}
        assert released == {"n1", "n2", "n3", "n4"} - set(info.nodes)
        # training goes on after the migration: the new layout's workers keep stepping
        text = (tmp_path / "batch.out").read_text()
        assert "pp4tp2dp1 -> pp2tp2dp1" in text
        # USR1 (Slurm's warning signal) with --on-signal suspend: stop at a step boundary, exit
        slurm.signal(job_id, "USR1", batch=True)
        wait("the job to end", lambda: _gone(slurm, job_id), timeout=120)
        suspended = store.find_job("elastic-it")
        assert suspended.state == "suspended" and suspended.checkpoint_step > 0
        assert (Path(suspended.checkpoint_path) / ".metadata").exists()  # written once, resumable anywhere
        assert "SIGUSR1" in (tmp_path / "batch.out").read_text()
    finally:
        try:
            slurm.cancel(job_id)
        except Exception:
            pass


def _open(url):
    try:
        s = Store(url, create=False)
        s.list_jobs()
        return s
    except Exception:
        return None


def _log_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


def cancel_quietly(slurm, *job_ids) -> None:
    """scancel each job that is not None, whatever state it is in (a test's cleanup)."""
    for job_id in job_ids:
        try:
            if job_id is not None:
                slurm.cancel(job_id)
        except Exception:
            pass


def _gone(slurm, job_id) -> bool:
    try:
        return slurm.job_info(job_id).state not in ("RUNNING", "COMPLETING")
    except Exception:
        return True
