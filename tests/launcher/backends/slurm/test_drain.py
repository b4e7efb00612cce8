"""An admin drains a node the job trains on (`scontrol update nodename=... state=drain`): the launcher sees
it at its next look at Slurm's node states and leaves the node by a live shrink by itself -- a succeeded,
bit-exact `preempt` migration noted "drained by the cluster", every committed step's loss equal to an
uninterrupted run -- and gives it back, so Slurm shows it DRAINED with no job on it."""
from __future__ import annotations

import subprocess
import time

import pytest

from db.store import migration_notes
from launcher.backends.slurm.client import SlurmCommands
from tests.launcher.backends.slurm.test_chaos import _failures, training_on_two_nodes
from tests.launcher.backends.slurm.test_launch_slurm import _gone, cancel_quietly, wait
from tests.launcher.backends.slurm.test_node_crash import _all_idle, submit_reference_job
from tests.launcher.loop.test_faults import check_curve, read_losses
from tests.records import verification_told

pytestmark = pytest.mark.slurm
# The launcher looks for drains every DrainWatch WATCH_S (30 s) on a node read up to READ_AGE_S (25 s) old: it
# may see a drain ~55 s after it. The job could train ~80 s after the drain (0.2 s a step), so the shrink comes
# before it ends (100 steps passed only when the drain happened to fall just before a fresh read); the test
# ends it a few steps after the shrink.
STEPS = 400


def _scontrol(testbed, *args: str) -> None:
    subprocess.run(["scontrol", *args], env=testbed.env(), check=True, capture_output=True, text=True)


def test_a_drained_node_is_left_live_and_given_back(slurm_testbed, tmp_path, capsys):
    slurm = SlurmCommands(env=slurm_testbed.env())
    job_id, url, loss_file = submit_reference_job(slurm, slurm_testbed, tmp_path, "elastic-drain", steps=STEPS,
                                                  step_sleep=0.2, sbatch="")
    drained = None
    try:
        store, job, batch, procs = training_on_two_nodes(slurm, job_id, url, "elastic-drain", loss_file)
        drained = next(n for n in procs if n != batch)
        _scontrol(slurm_testbed, "update", f"nodename={drained}", "state=drain", "reason=elastic-test")
        t0 = time.monotonic()
        (mig,) = wait("the shrink off the drained node", lambda: _failures(store, job.id, 1), timeout=120)
        with capsys.disabled():
            print(f"\n[drain] drain -> shrink recorded: {time.monotonic() - t0:.1f} s")
        assert (mig.trigger, mig.status) == ("preempt", "succeeded") and verification_told(mig), mig.error
        assert (mig.from_layout, mig.to_layout) == ("pp2tp1dp2", "pp2tp1dp1")
        wait("the migration's note", lambda: any("drained by the cluster" in n for n in
                                                 migration_notes(_failures(store, job.id, 1)[0])), timeout=30)
        wait("Slurm's job without the node", lambda: slurm.job_info(job_id).nodes == [batch], timeout=60)
        wait(f"{drained} drained with no job", lambda: slurm_testbed.node_states().get(drained) == "drain",
             timeout=60)
        trained = mig.at_step + 5  # the new layout trains on; then the job is ended (its end is not under test)
        wait(f"step {trained}", lambda: len(read_losses(loss_file)) >= trained, timeout=60)
        cancel_quietly(slurm, job_id)
        wait("the job to end", lambda: _gone(slurm, job_id), timeout=60)
        check_curve(read_losses(loss_file), trained)
    finally:
        cancel_quietly(slurm, job_id)
        if drained is not None:
            _scontrol(slurm_testbed, "update", f"nodename={drained}", "state=resume")
            wait("every node idle again", lambda: _all_idle(slurm_testbed), timeout=120)
