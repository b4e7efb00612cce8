"""A node that really dies on the Slurm testbed: pp2dp2 on 2 nodes x 2 GPUs (`sbatch --no-kill`, resilient
placement: one full replica per node), then the non-batch node crashes -- its slurmd, step daemons and
workers killed at one instant (`elastic testbed crash`), so nothing tells srun or slurmctld.

The survivors' all-reduces fail with "Connection closed by peer"; they post a suspicion instead of
exiting, the launcher finds the node gone (its one-task step cannot start) and moves the job onto the
batch node's replica: a succeeded, bit-exact `failure` migration, every committed step's loss equal to
an uninterrupted run, no step repeated. Slurm never cancels the job and shows it without the node. The
node comes back (`elastic testbed revive`), and `elastic resize` grows the job onto it again.
"""
from __future__ import annotations

import sys
import time

import pytest

from launcher.backends.slurm.client import SlurmCommands
from launcher.cli import main as elastic
from tests.launcher.backends.slurm.test_chaos import _failures, _last_step, training_on_two_nodes
from tests.launcher.backends.slurm.test_launch_slurm import _gone, wait
from tests.launcher.loop.test_faults import check_curve, read_losses
from tests.paths import ROOT
from tests.records import verification_told

pytestmark = pytest.mark.slurm
STEPS = 120


def _all_idle(testbed) -> bool:
    states = testbed.node_states()
    return sorted(states) == sorted(testbed.nodes) and all(s == "idle" for s in states.values())


def test_a_crashed_node_is_survived_from_replicas_and_the_job_grows_back_onto_it(slurm_testbed, tmp_path, capsys):
    slurm = SlurmCommands(env=slurm_testbed.env())
    job_id, url, loss_file = submit_reference_job(slurm, slurm_testbed, tmp_path, "elastic-crash", steps=STEPS,
                                                  step_sleep=0.25)
    crashed = None
    try:
        store, job, batch, procs = training_on_two_nodes(slurm, job_id, url, "elastic-crash", loss_file)
        crashed = next(n for n in procs if n != batch)
        t0 = time.monotonic()
        slurm_testbed.crash_node(crashed)
        (mig,) = wait("the failure migration", lambda: _failures(store, job.id, 1), timeout=120)
        took = time.monotonic() - t0
        assert (mig.trigger, mig.status) == ("failure", "succeeded") and verification_told(mig), mig.error
        assert (mig.from_layout, mig.to_layout) == ("pp2tp1dp2", "pp2tp1dp1")
        at = _last_step(loss_file)
        wait("steps after the recovery", lambda: _last_step(loss_file) >= at + 3, timeout=60)
        with capsys.disabled():
            print(f"\n[node crash] crash -> failure migration done: {took:.1f} s; training again at step {at}")
        info = slurm.job_info(job_id)
        assert info.state == "RUNNING" and info.nodes == [batch], info  # the job, without the crashed node
        assert [n.state for n in store.list_nodes(job.id) if n.name == crashed] == ["failed"]

        slurm_testbed.revive_node(crashed)
        wait(f"{crashed} back in service", lambda: slurm_testbed.node_states().get(crashed) == "idle", timeout=90)
        assert elastic(["resize", "elastic-crash", "--nodes", "2", "--db", url]) == 0
        grow = wait("the grow", lambda: _failures(store, job.id, 2), timeout=150)[1]
        assert (grow.trigger, grow.status, grow.bit_exact) == ("resize", "succeeded", True), grow.error
        assert (grow.from_layout, grow.to_layout) == ("pp2tp1dp1", "pp2tp1dp2")
        wait("the job to end", lambda: _gone(slurm, job_id), timeout=180)
        assert store.find_job("elastic-crash").state == "finished"
        check_curve(read_losses(loss_file), STEPS)
    finally:
        end_and_revive(slurm, job_id, slurm_testbed, crashed)


def submit_reference_job(slurm, testbed, tmp_path, name: str, *, steps: int, step_sleep: float, nodes: int = 2,
                         sbatch: str = "--no-kill", launch: str = "", checkpoint_every: int = 0):
    """Once every testbed node is idle, submit Slurm job `name`: elastic-launch of the reference GPT, pp2dp2 or
    pp2dp1 on up to 2 nodes x 2 GPUs (resilient placement), `nodes` to start with; (job id, db url, loss file)."""
    url, loss_file = f"sqlite:///{tmp_path}/e.db", tmp_path / "loss.txt"
    wait("every node idle", lambda: _all_idle(testbed), timeout=120)
    script = f"""#!/bin/bash
#SBATCH --nodes={nodes} --ntasks-per-node=2 --gres=gpu:2 {sbatch} --job-name={name} --output={tmp_path}/batch.out --chdir={tmp_path}
export PYTHONPATH={ROOT}
exec {sys.executable} -m launcher.launch --nnodes 1:2 --gpus-per-node 2 --layouts pp2dp2,pp2dp1 --placement resilient \\
    {launch} --checkpoint-every {checkpoint_every} --db {url} --log-dir {tmp_path}/logs -- python -m launcher.worker --layers 4 \\
    --hidden 128 --vocab 512 --log-every 0 --loss-file {loss_file} --steps {steps} --step-sleep {step_sleep}
"""
    return slurm.submit(script), url, loss_file


def end_and_revive(slurm, job_id: int, testbed, crashed: str | None) -> None:
    """Cancel the job, start the crashed node's slurmd again, and wait until every node is idle: the next
    Slurm test starts on the whole testbed."""
    try:
        slurm.cancel(job_id)
    except Exception:
        pass
    if crashed is not None:
        testbed.revive_node(crashed)
        wait("every node idle again", lambda: _all_idle(testbed), timeout=180)
