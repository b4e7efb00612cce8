"""--policy opportunistic on the Slurm testbed, with nobody in the loop: an elastic job started on 1 node of
an idle cluster grows onto a second one by itself; then a plain job is submitted that needs more nodes than
are idle, and the elastic job gives back exactly what it lacks, so the plain job starts. Both resizes are
`policy` migrations in history with their reasons, bit-exact, and the loss curve is an uninterrupted run's."""
from __future__ import annotations

import time

import pytest

from db.store import migration_notes
from launcher.backends.slurm.client import SlurmCommands
from tests.launcher.backends.slurm.test_chaos import _failures, _last_step
from tests.launcher.backends.slurm.test_launch_slurm import _gone, _open, cancel_quietly, wait
from tests.launcher.backends.slurm.test_node_crash import _all_idle, submit_reference_job
from tests.launcher.loop.test_faults import check_curve, read_losses

pytestmark = pytest.mark.slurm
STEPS = 400


def test_the_job_grows_into_idle_nodes_and_yields_to_a_pending_job_by_itself(slurm_testbed, tmp_path, capsys):
    slurm = SlurmCommands(env=slurm_testbed.env())
    job_id, url, loss_file = submit_reference_job(
        slurm, slurm_testbed, tmp_path, "elastic-policy", steps=STEPS, step_sleep=0.1, nodes=1,
        launch="--policy opportunistic --policy-idle 3 --policy-dwell 3 --policy-watch 2")
    plain = None
    try:
        store = wait("the job in the database", lambda: _open(url), timeout=60)
        job = wait("job registered", lambda: store.find_job("elastic-policy"), timeout=180)
        (grow,) = wait("the policy's grow", lambda: _failures(store, job.id, 1), timeout=150)
        assert (grow.trigger, grow.status, grow.bit_exact) == ("policy", "succeeded", True), grow.error
        assert (grow.from_layout, grow.to_layout) == ("pp2tp1dp1", "pp2tp1dp2")
        assert any("idle for" in n and "no job pending" in n for n in migration_notes(grow)), migration_notes(grow)
        wait("steps on 2 nodes", lambda: _last_step(loss_file) >= 10 and
             read_losses(loss_file)[-1][2] == "pp2tp1dp2", timeout=60)

        t0 = time.monotonic()  # 2 nodes idle, 2 held: a job for 3 whole nodes lacks 1
        plain = slurm.submit(f"#!/bin/bash\n#SBATCH --nodes=3 --exclusive --job-name=plain --output={tmp_path}/plain.out"
                             "\nsleep 20\n")
        wait("the plain job running", lambda: slurm.job_info(plain).state == "RUNNING", timeout=90)
        started = time.monotonic() - t0
        shrink = wait("the policy's yield", lambda: _failures(store, job.id, 2), timeout=30)[1]
        assert (shrink.trigger, shrink.status, shrink.to_layout) == ("policy", "succeeded", "pp2tp1dp1"), shrink.error
        assert any(f"job {plain} (plain) pending for 3 node(s)" in n and "giving 1 back" in n
                   for n in migration_notes(shrink)), migration_notes(shrink)
        with capsys.disabled():
            print(f"\n[policy] plain job submitted -> running: {started:.1f} s (the yield included)")
        wait("the elastic job to end", lambda: _gone(slurm, job_id), timeout=240)
        check_curve(read_losses(loss_file), STEPS)
    finally:
        cancel_quietly(slurm, plain, job_id)
        wait("every node idle again", lambda: _all_idle(slurm_testbed), timeout=120)
