"""The node that runs the batch script and elastic-launch crashes, on the real Slurm testbed: the job was
submitted with `--requeue --no-kill` and safety checkpoints every 4 steps. Slurm finds the node dead by its
pings (SlurmdTimeout=30 here), requeues the batch script on the nodes left, and the new elastic-launch
takes over the same job by itself (launcher.loop.suspend.requeued_job) from the newest complete
checkpoint: one `requeue` migration in its history with the steps lost (at most the interval), and every
step's loss -- the ones run twice included -- equal to an uninterrupted run.
"""
from __future__ import annotations

import sys
import time

import pytest

from launcher.backends.slurm.client import SlurmCommands
from tests.launcher.backends.slurm.test_chaos import _last_step, training_on_two_nodes
from tests.launcher.backends.slurm.test_launch_slurm import wait
from tests.launcher.backends.slurm.test_node_crash import _all_idle, end_and_revive
from tests.launcher.loop.test_faults import read_losses, reference_losses
from tests.paths import ROOT

pytestmark = pytest.mark.slurm
STEPS, EVERY = 40, 4


def test_a_crashed_batch_node_is_requeued_and_the_job_resumes_by_itself(slurm_testbed, tmp_path, capsys):
    slurm = SlurmCommands(env=slurm_testbed.env())
    url, loss_file, ck = f"sqlite:///{tmp_path}/e.db", tmp_path / "loss.txt", tmp_path / "ck"
    wait("every node idle", lambda: _all_idle(slurm_testbed), timeout=120)
    script = f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --gres=gpu:2 --no-kill --requeue --job-name=elastic-requeue --output={tmp_path}/batch-%j-%s.out --open-mode=append --chdir={tmp_path}
export PYTHONPATH={ROOT}
exec {sys.executable} -m launcher.launch --nnodes 1:2 --gpus-per-node 2 --layouts pp2dp2,pp2dp1 --placement resilient \\
    --checkpoint-every {EVERY} --checkpoint-dir {ck} --db {url} --log-dir {tmp_path}/logs -- python -m launcher.worker \\
    --layers 4 --hidden 128 --vocab 512 --log-every 0 --loss-file {loss_file} --steps {STEPS} --step-sleep 0.25
"""
    job_id = slurm.submit(script)
    crashed = None
    try:
        store, job, batch, _procs = training_on_two_nodes(slurm, job_id, url, "elastic-requeue", loss_file)
        wait("a complete safety checkpoint", lambda: list(ck.glob("step-*/.metadata")), timeout=120)
        wait("steps past it", lambda: _last_step(loss_file) >= 2 * EVERY + 2, timeout=120)
        crashed, t0 = batch, time.monotonic()
        slurm_testbed.crash_node(batch)
        requeue = wait("the requeue migration", lambda: [m for m in store.recent_migrations(job.id, limit=20)
                                                         if m.trigger == "requeue" and m.status != "running"],
                       timeout=240, every=1.0)[0]
        took = time.monotonic() - t0
        assert requeue.status == "succeeded", requeue.error
        assert 0 <= requeue.steps_lost <= EVERY, requeue.steps_lost
        wait("the job to finish", lambda: store.find_job("elastic-requeue").state == "finished", timeout=240)
        with capsys.disabled():
            print(f"\n[batch node crash] crash -> resumed from step {requeue.at_step}: {took:.0f} s, "
                  f"{requeue.steps_lost} steps lost")
        assert [j.id for j in store.list_jobs() if j.name == "elastic-requeue"] == [job.id]  # the same job
        info = slurm.job_info(job_id)
        assert crashed not in info.nodes, info
        rows = read_losses(loss_file)
        losses: dict[int, float] = {}
        for step, loss, _layout in rows:  # a step run twice (after the checkpoint, before the crash) gave one loss
            assert abs(losses.setdefault(step, loss) - loss) <= 1e-5 * abs(loss), (step, losses[step], loss)
        assert sorted(losses) == list(range(1, STEPS + 1))
        for (step, loss), ref in zip(sorted(losses.items()), reference_losses(STEPS)):
            assert abs(loss - ref) <= 1e-5 * abs(ref), f"step {step}: {loss} vs uninterrupted {ref}"
    finally:
        end_and_revive(slurm, job_id, slurm_testbed, crashed)
