"""Slurm faults on the real testbed: the controller goes away in the middle of a resize.

`elastic resize` shrinks a 2-node job to 1; slurmctld is stopped as soon as the migration starts,
so the release (`scontrol update ... NodeList=`) after the state moved is refused; slurmctld is
then restarted with its saved state. The job keeps training on the node it has, and `elastic
history` says what happened (the error text). A companion job that never starts is tested in
test_slurm_companion.py.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from launcher.cli import main as elastic
from launcher.backends.slurm.client import SlurmCommands
from tests.launcher.backends.slurm.test_launch_slurm import ROOT, _open, wait

pytestmark = pytest.mark.slurm


def test_release_refused_while_slurmctld_is_down_then_restarted(slurm_testbed, tmp_path, capsys):
    env = slurm_testbed.env()
    slurm = SlurmCommands(env=env)
    url = f"sqlite:///{tmp_path}/e.db"
    loss = tmp_path / "loss.txt"
    # the launcher's Slurm commands (its own slurm.conf, as a user's may be) give up on the stopped
    # controller after 4 s instead of 18 s (2 x (MessageTimeout - 1) s, measured); the testbed keeps 10
    client_conf = tmp_path / "slurm.conf"
    client_conf.write_text(re.sub(r"(?m)^MessageTimeout=\d+$", "MessageTimeout=3", Path(env["SLURM_CONF"]).read_text()))
    script = f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --gres=gpu:1 --job-name=elastic-ft --output={tmp_path}/batch.out --chdir={tmp_path}
export PYTHONPATH={ROOT} SLURM_CONF={client_conf}
exec {sys.executable} -m launcher.launch --nnodes 1:2 --gpus-per-node 1 --layouts pp2,pp1 --db {url} \\
    --log-dir {tmp_path}/logs -- python -m launcher.worker --layers 4 --hidden 128 --vocab 512 \\
    --step-sleep 0.3 --log-every 0 --loss-file {loss}
"""
    job_id = slurm.submit(script)
    restarted = False
    try:
        store = wait("the job in the database", lambda: _open(url), timeout=60)
        job = wait("job registered", lambda: store.find_job("elastic-ft"), timeout=120)
        wait("training", lambda: loss.exists() and len(loss.read_text().splitlines()) >= 2, timeout=60, every=0.2)
        assert elastic(["resize", "elastic-ft", "--nodes", "1", "--db", url]) == 0
        wait("the migration to start", lambda: store.recent_migrations(job.id), timeout=30, every=0.05)
        slurm_testbed.stop_slurmctld()  # before the state has moved and the node is given back
        mig = wait("the migration to finish", lambda: [m for m in store.recent_migrations(job.id)
                                                        if m.status != "running"], timeout=90)[0]
        slurm_testbed.restart_slurmctld()
        restarted = True
        # the state moved (bit-exact) but the release was refused: recorded, nodes kept
        assert mig.status == "succeeded" and mig.bit_exact is True, mig
        assert mig.error and mig.error.startswith("node release failed"), mig.error
        assert (mig.from_layout, mig.to_layout) == ("pp2tp1dp1", "pp1tp1dp1")
        (req,) = store.list_requests(job.id)
        assert req.status == "failed" and "node release failed" in req.message
        # the job trains on after the controller came back, on the node it kept
        before = len(loss.read_text().splitlines())
        wait("more steps", lambda: len(loss.read_text().splitlines()) >= before + 3, timeout=30, every=0.2)
        info = slurm.job_info(job_id)
        assert info.state == "RUNNING"
        assert store.current_rank_map(job.id).layout == "pp1tp1dp1"
        steps = [int(line.split()[0]) for line in loss.read_text().splitlines()]
        assert steps == list(range(1, len(steps) + 1))
        # `elastic history` shows it
        capsys.readouterr()
        assert elastic(["history", "--db", url, "--json"]) == 0
        (h,) = json.loads(capsys.readouterr().out)
        assert h["status"] == "succeeded" and h["error"] == mig.error
    finally:
        if not restarted:
            slurm_testbed.restart_slurmctld()
        try:
            slurm.cancel(job_id)
        except Exception:
            pass
