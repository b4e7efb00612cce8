"""On the real Slurm testbed: one task of a node's step dies (SIGKILL inside a training step), the
step's other task runs on (--kill-on-bad-exit=0), the launcher sees the death at once from srun's
report and re-plans pp2dp2 from the surviving replica: a succeeded `failure` migration, bit-exact,
no node failed, and the job trains on."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launcher.backends.slurm.client import SlurmCommands
from tests.launcher.backends.slurm.test_launch_slurm import _gone, _log_has, _open, wait

pytestmark = pytest.mark.slurm
from tests.paths import ROOT
from tests.records import verification_told


def test_a_task_dies_its_node_and_the_job_train_on(slurm_testbed, tmp_path):
    slurm = SlurmCommands(env=slurm_testbed.env())
    url = f"sqlite:///{tmp_path}/e.db"
    script = f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --gres=gpu:2 --job-name=elastic-fd --output={tmp_path}/batch.out --chdir={tmp_path}
export PYTHONPATH={ROOT} ELASTIC_FAULT=3:step:6
exec {sys.executable} -m launcher.launch --nnodes 1:2 --gpus-per-node 2 --layouts pp2dp2,pp2 --db {url} \\
    --log-dir {tmp_path}/logs -- python -m launcher.worker --layers 4 --hidden 128 --vocab 512 --log-every 0 \\
    --steps 30
"""
    job_id = slurm.submit(script)
    try:
        store = wait("the job in the database", lambda: _open(url), timeout=60)
        job = wait("job registered", lambda: store.find_job("elastic-fd"), timeout=180)
        mig = wait("the failure migration", lambda: [m for m in store.recent_migrations(job.id)
                                                     if m.status != "running"], timeout=240)[0]
        assert (mig.trigger, mig.status) == ("failure", "succeeded") and verification_told(mig), mig.error
        assert (mig.from_layout, mig.to_layout) == ("pp2tp1dp2", "pp2tp1dp1")
        assert "failed" not in {n.state for n in store.list_nodes(job.id)}
        wait("the job to end", lambda: _gone(slurm, job_id), timeout=240)
        assert store.find_job("elastic-fd").state == "finished"
        assert any(_log_has(p, "task 1: Killed") for p in (tmp_path / "logs").glob("step-*.log"))
    finally:
        try:
            slurm.cancel(job_id)
        except Exception:
            pass
