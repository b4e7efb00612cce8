"""Bounded chaos on the real Slurm testbed: pp2dp2 on 2 nodes x 2 GPUs (resilient placement).

Two kills, each covered by a DP replica: first one task of the batch node's step (SIGKILL of its
worker pid), then every worker of the other node (its step ends). The layouts are chosen so that
the job keeps a replica after the first kill (3 devices: pp1dp2, one replica per node), so both
failures must be recovered from replicas: two succeeded `failure` migrations, bit-exact, and every
committed step's loss matches an uninterrupted single-process run, no step repeated or skipped.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from launcher.wire.env import ENV_NODE
from launcher.backends.slurm.client import SlurmCommands
from tests.launcher.loop.test_faults import check_curve, read_losses
from tests.launcher.backends.slurm.test_launch_slurm import _gone, _open, wait

pytestmark = pytest.mark.slurm
from tests.paths import ROOT
from tests.records import verification_told
STEPS = 24


def _workers(slurm_job: int) -> dict[str, list[int]]:
    """node -> pids of the job's live worker processes there (read from /proc: cmdline and environ)."""
    out: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"launcher.worker" not in (entry / "cmdline").read_bytes():
                continue
            env = dict(kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == str(slurm_job).encode() and ENV_NODE.encode() in env:
            out.setdefault(env[ENV_NODE.encode()].decode(), []).append(int(entry.name))
    return out


def _last_step(loss_file: Path) -> int:
    rows = read_losses(loss_file) if loss_file.exists() else []
    return rows[-1][0] if rows else 0


def _failures(store, job_id: int, count: int):
    migs = sorted(store.recent_migrations(job_id, limit=20), key=lambda m: m.id)
    done = [m for m in migs if m.status != "running"]
    return done if len(done) >= count else None


def training_on_two_nodes(slurm, job_id: int, url: str, name: str, loss_file: Path):
    """Once Slurm job `job_id` (elastic job `name`, 2 nodes x 2 workers) has trained a few steps:
    (store, job record, batch node, node -> its workers' pids)."""
    store = wait("the job in the database", lambda: _open(url), timeout=60)
    job = wait("job registered", lambda: store.find_job(name), timeout=180)
    batch = slurm.job_info(job_id).batch_host
    wait("a few steps", lambda: _last_step(loss_file) >= 4, timeout=180)
    procs = _workers(job_id)
    assert sorted(map(len, procs.values())) == [2, 2], procs
    return store, job, batch, procs


def test_a_task_then_a_node_killed_recovered_from_replicas(slurm_testbed, tmp_path):
    slurm = SlurmCommands(env=slurm_testbed.env())
    url, loss_file = f"sqlite:///{tmp_path}/e.db", tmp_path / "loss.txt"
    script = f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --gres=gpu:2 --job-name=elastic-chaos --output={tmp_path}/batch.out --chdir={tmp_path}
export PYTHONPATH={ROOT}
exec {sys.executable} -m launcher.launch --nnodes 1:2 --gpus-per-node 2 --layouts pp2dp2,pp1dp2,pp1 --placement resilient \\
    --checkpoint-every 0 --db {url} --log-dir {tmp_path}/logs -- python -m launcher.worker --layers 4 --hidden 128 \\
    --vocab 512 --log-every 0 --loss-file {loss_file} --steps {STEPS}
"""
    job_id = slurm.submit(script)
    try:
        store, job, batch, procs = training_on_two_nodes(slurm, job_id, url, "elastic-chaos", loss_file)
        other = next(n for n in procs if n != batch)
        os.kill(procs[batch][0], signal.SIGKILL)  # one task of the batch node's step
        first = wait("the first failure migration", lambda: _failures(store, job.id, 1), timeout=120)[0]
        assert (first.trigger, first.status) == ("failure", "succeeded") and verification_told(first), first.error
        assert (first.from_layout, first.to_layout) == ("pp2tp1dp2", "pp1tp1dp2")
        at = _last_step(loss_file)
        wait("steps after the first recovery", lambda: _last_step(loss_file) >= at + 3, timeout=120)
        for pid in _workers(job_id)[other]:  # every worker of the other node: its step ends
            os.kill(pid, signal.SIGKILL)
        second = wait("the second failure migration", lambda: _failures(store, job.id, 2), timeout=120)[1]
        assert (second.trigger, second.status) == ("failure", "succeeded") and verification_told(second), second.error
        assert (second.from_layout, second.to_layout) == ("pp1tp1dp2", "pp1tp1dp1")
        wait("the job to end", lambda: _gone(slurm, job_id), timeout=180)
        job = store.find_job("elastic-chaos")
        assert job.state == "finished"
        assert [n.state for n in store.list_nodes(job.id) if n.name == other] == ["failed"]
        assert [n.state for n in store.list_nodes(job.id) if n.name == batch] != ["failed"]
        assert len(store.recent_migrations(job.id, limit=20)) == 2
        check_curve(read_losses(loss_file), STEPS)
    finally:
        try:
            slurm.cancel(job_id)
        except Exception:
            pass
