"""The node that runs the batch script and elastic-launch dies, on the Slurm testbed: the job comes back by
itself. pp2dp2 on 2 nodes x 2 GPUs with a safety checkpoint every 4 steps; when it starts, the launcher queues
the job's successor (its own batch script, held a minute ahead and pushed back while the launcher lives:
launcher.backends.slurm.successor) and says the job survives the loss of the batch node. Then the batch node
crashes (`elastic testbed crash`: slurmd, step daemons, elastic-launch and its workers SIGKILLed at one
instant). Nobody pushes the successor back; it starts on the nodes left, finds the job's batch node down,
cancels what is left of the job (Slurm keeps a --no-kill job running without its batch step), takes the same
job over in the database from the newest complete safety checkpoint -- a `requeue` migration with its steps
lost (at most the interval) -- and trains on: every step re-run after the checkpoint has the loss it had the
first time."""
from __future__ import annotations

import time

import pytest

from tests.launcher.backends.slurm.test_launch_slurm import _open, cancel_quietly, wait
from tests.launcher.backends.slurm.test_node_crash import _all_idle, submit_reference_job
from launcher.backends.slurm.client import SlurmCommands
from tests.launcher.loop.test_faults import read_losses

pytestmark = pytest.mark.slurm
EVERY = 4
NAME = "elastic-batch"


def _requeue(store, job_id):
    return [m for m in store.recent_migrations(job_id, limit=20) if m.trigger == "requeue" and m.status != "running"]


def test_the_batch_node_dies_and_the_successor_resumes_the_same_job(slurm_testbed, tmp_path, capsys):
    slurm = SlurmCommands(env=slurm_testbed.env())
    first, url, loss_file = submit_reference_job(slurm, slurm_testbed, tmp_path, NAME, steps=400, step_sleep=0.2,
                                                 checkpoint_every=EVERY)
    crashed = None
    try:
        store = wait("the job in the database", lambda: _open(url), timeout=60)
        job = wait("job registered", lambda: store.find_job(NAME), timeout=180)
        successor = wait("the successor queued", lambda: [j for j in slurm.jobs() if j.name == NAME
                                                          and j.job_id != first and j.state == "PENDING"], timeout=60)[0]
        assert successor.reason == "BeginTime", successor  # held back while the launcher lives
        assert wait("the survival claim", lambda: (store.launch_spec(job.id) or {}).get("survives"),
                    timeout=30)["batch"] is True
        wait("two safety checkpoints", lambda: (store.find_job(NAME).checkpoint_step or 0) >= 2 * EVERY, timeout=120)
        crashed = slurm.job_info(first).batch_host
        before = read_losses(loss_file)[-1][0]
        t0 = time.monotonic()
        slurm_testbed.crash_node(crashed)
        (mig,) = wait("the successor's takeover", lambda: _requeue(store, job.id), timeout=180)
        took = time.monotonic() - t0
        assert mig.status == "succeeded" and "successor" in (mig.error or ""), (mig.status, mig.error)
        assert 0 <= mig.steps_lost <= EVERY + 1, (mig.steps_lost, mig.at_step, before)
        record = store.find_job(NAME)
        assert record.id == job.id and record.state == "running" and record.slurm_job_id == str(successor.job_id)
        at = mig.at_step
        wait("steps after the takeover", lambda: read_losses(loss_file)[-1][0] >= at + 3, timeout=90)
        with capsys.disabled():
            print(f"\n[batch node crash] crash -> training again from step {at}: {took:.1f} s, "
                  f"{mig.steps_lost} steps lost")
        first_run: dict[int, float] = {}
        for step, loss, _layout in read_losses(loss_file):  # a step run again gives the same loss (resumed, not restarted)
            assert first_run.setdefault(step, loss) == loss, (step, first_run[step], loss)
        assert sorted(first_run) == list(range(1, max(first_run) + 1))  # no step skipped
    finally:
        cancel_quietly(slurm, *[j.job_id for j in slurm.jobs() if j.name == NAME], first)
        if crashed is not None:
            slurm_testbed.revive_node(crashed)
        wait("every node idle again", lambda: _all_idle(slurm_testbed), timeout=180)
