"""Growing beyond the allocation on the real testbed, through a companion job.

(a) A job holds 2 of the 4 nodes (sbatch --nodes=2); `elastic resize --nodes 4` makes the launcher
submit a companion job for 2 more nodes, start workers on them as steps of that job, and migrate
onto 4 nodes (bit-exact, recorded as a resize). Shrinking back to 2 moves the state off the
companion's nodes and cancels it.
(c) A job on 4 nodes shrinks to 2 (Slurm takes the 2 back for good), then grows to 4 again: a
companion job gets the released nodes, and the job trains on them again.
(b) The other 2 nodes are taken by a blocker job: the companion stays pending, is cancelled after
--companion-timeout, the request fails with "companion job N did not start within T s", the job
trains on, and `elastic history` says what happened.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import main as elastic
from launcher.backends.slurm.client import SlurmCommands
from tests.launcher.backends.slurm.test_launch_slurm import ROOT, _gone, _open, wait

pytestmark = pytest.mark.slurm


def _script(tmp_path: Path, name: str, url: str, loss: Path, timeout: int, nodes: int = 2) -> str:
    return f"""#!/bin/bash
#SBATCH --nodes={nodes} --ntasks-per-node=2 --gres=gpu:2 --job-name={name} --output={tmp_path}/batch.out --chdir={tmp_path}
export PYTHONPATH={ROOT}
exec {sys.executable} -m launcher.launch --nnodes 2:4 --gpus-per-node 2 --layouts pp4tp2,pp2tp2 --db {url} \\
    --companion-timeout {timeout} --log-dir {tmp_path}/logs -- python -m launcher.worker --layers 4 --hidden 128 \\
    --vocab 512 --step-sleep 0.2 --log-every 0 --loss-file {loss}
"""


def _steps(loss: Path) -> list[int]:
    return [int(line.split()[0]) for line in loss.read_text().splitlines()] if loss.exists() else []


def _companions(slurm, name: str):
    return [j for j in slurm.jobs() if j.name.startswith(f"{name}-companion-")]


def _done(store, job_id: int, count: int, timeout: float = 150.0):
    def finished():
        reqs = [r for r in store.list_requests(job_id) if r.status != "pending"]
        return reqs if len(reqs) >= count else None

    return max(wait(f"request {count} carried out", finished, timeout=timeout), key=lambda r: r.id)


def test_grow_through_companion_job_then_shrink_cancels_it(slurm_testbed, tmp_path, capsys):
    slurm = SlurmCommands(env=slurm_testbed.env())
    url = f"sqlite:///{tmp_path}/e.db"
    loss = tmp_path / "loss.txt"
    job_id = slurm.submit(_script(tmp_path, "elastic-co", url, loss, 60))
    try:
        store = wait("the job in the database", lambda: _open(url), timeout=60)
        job = wait("job registered", lambda: store.find_job("elastic-co"), timeout=120)
        main_nodes = slurm.job_info(job_id).nodes
        assert len(main_nodes) == 2
        wait("training", lambda: len(_steps(loss)) >= 2, timeout=60, every=0.2)
        # grow to 4 nodes: the allocation has only 2, so a companion job brings the other 2
        assert elastic(["resize", "elastic-co", "--nodes", "4", "--db", url]) == 0
        req = _done(store, job.id, 1)
        assert req.status == "done", req.message
        (comp,) = _companions(slurm, "elastic-co")
        assert comp.name == "elastic-co-companion-1" and comp.state == "RUNNING"
        assert len(comp.nodes) == 2 and not set(comp.nodes) & set(main_nodes)
        current = store.current_rank_map(job.id)
        assert current.layout == "pp4tp2dp1"
        assert {e.node for e in current.entries} == set(main_nodes) | set(comp.nodes)
        (mig,) = store.recent_migrations(job.id)
        assert mig.status == "succeeded" and mig.trigger == "resize" and mig.bit_exact is True, mig
        assert (mig.from_layout, mig.to_layout) == ("pp2tp2dp1", "pp4tp2dp1") and mig.bytes_moved > 0
        before = len(_steps(loss))
        wait("training on 4 nodes", lambda: len(_steps(loss)) >= before + 3, timeout=60, every=0.2)
        assert "pp4tp2dp1" in loss.read_text().splitlines()[-1]
        assert slurm.job_info(job_id).num_nodes == 2, "the job itself never grew"
        # shrink back to 2: the state leaves the companion's nodes, then the companion job ends
        assert elastic(["resize", "elastic-co", "--nodes", "2", "--db", url]) == 0
        req = _done(store, job.id, 2)
        assert req.status == "done", req.message
        assert f"companion job {comp.job_id} cancelled" in req.message
        wait("the companion job to end", lambda: _gone(slurm, comp.job_id), timeout=30)
        info = slurm.job_info(job_id)
        assert info.state == "RUNNING" and sorted(info.nodes) == sorted(main_nodes)
        current = store.current_rank_map(job.id)
        assert current.layout == "pp2tp2dp1" and {e.node for e in current.entries} == set(main_nodes)
        shrink = store.recent_migrations(job.id)[0]
        assert shrink.status == "succeeded" and shrink.bit_exact is True and shrink.error is None
        states = {n.name: n.state for n in store.list_nodes(job.id)}
        assert all(states[n] == "released" for n in comp.nodes)
        before = len(_steps(loss))
        wait("training on 2 nodes again", lambda: len(_steps(loss)) >= before + 3, timeout=60, every=0.2)
        steps = _steps(loss)
        assert steps == list(range(1, len(steps) + 1)), "no step lost or repeated across both migrations"
        capsys.readouterr()
        assert elastic(["history", "--db", url, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert sorted((r["from_layout"], r["to_layout"], r["status"]) for r in rows) == [
            ("pp2tp2dp1", "pp4tp2dp1", "succeeded"), ("pp4tp2dp1", "pp2tp2dp1", "succeeded")]
    finally:
        _cleanup(slurm_testbed, slurm, [job_id], "elastic-co-companion-1")


@pytest.mark.slurm_core
def test_grow_after_shrink_gets_the_released_nodes_back_through_a_companion(slurm_testbed, tmp_path):
    slurm = SlurmCommands(env=slurm_testbed.env())
    url = f"sqlite:///{tmp_path}/e.db"
    loss = tmp_path / "loss.txt"
    job_id = slurm.submit(_script(tmp_path, "elastic-cr", url, loss, 60, nodes=4))
    try:
        store = wait("the job in the database", lambda: _open(url), timeout=60)
        job = wait("job registered", lambda: store.find_job("elastic-cr"), timeout=120)
        wait("training", lambda: len(_steps(loss)) >= 2, timeout=60, every=0.2)
        assert elastic(["resize", "elastic-cr", "--nodes", "2", "--db", url]) == 0
        assert _done(store, job.id, 1).status == "done"
        kept = slurm.job_info(job_id).nodes
        assert len(kept) == 2
        released = sorted({"n1", "n2", "n3", "n4"} - set(kept))
        assert elastic(["resize", "elastic-cr", "--nodes", "4", "--db", url]) == 0
        req = _done(store, job.id, 2)
        assert req.status == "done", req.message
        (comp,) = _companions(slurm, "elastic-cr")
        assert sorted(comp.nodes) == released and comp.state == "RUNNING"
        assert slurm.job_info(job_id).num_nodes == 2
        grow = store.recent_migrations(job.id)[0]
        assert grow.status == "succeeded" and grow.trigger == "resize" and grow.bit_exact is True, grow
        assert (grow.from_layout, grow.to_layout) == ("pp2tp2dp1", "pp4tp2dp1")
        current = store.current_rank_map(job.id)
        assert {e.node for e in current.entries} == {"n1", "n2", "n3", "n4"}
        assert {n.name: n.state for n in store.list_nodes(job.id)} == dict.fromkeys(("n1", "n2", "n3", "n4"), "active")
        before = len(_steps(loss))
        wait("training on 4 nodes again", lambda: len(_steps(loss)) >= before + 3, timeout=60, every=0.2)
        steps = _steps(loss)
        assert steps == list(range(1, len(steps) + 1)) and "pp4tp2dp1" in loss.read_text().splitlines()[-1]
    finally:
        _cleanup(slurm_testbed, slurm, [job_id], "elastic-cr-companion-1")


def test_companion_that_cannot_start_is_cancelled_and_the_job_trains_on(slurm_testbed, tmp_path, capsys):
    slurm = SlurmCommands(env=slurm_testbed.env())
    url = f"sqlite:///{tmp_path}/e.db"
    loss = tmp_path / "loss.txt"
    job_id = slurm.submit(_script(tmp_path, "elastic-cb", url, loss, 3))  # waited out: keep it short
    blocker = None
    try:
        store = wait("the job in the database", lambda: _open(url), timeout=60)
        job = wait("job registered", lambda: store.find_job("elastic-cb"), timeout=120)
        # take the two other nodes whole, so a companion job cannot start
        blocker = slurm.submit("#!/bin/bash\n#SBATCH --nodes=2 --exclusive --job-name=blocker "
                               "--output=/dev/null\nsleep 600\n")
        wait("the blocker to run", lambda: slurm.job_info(blocker).state == "RUNNING", timeout=30)
        wait("training", lambda: len(_steps(loss)) >= 2, timeout=60, every=0.2)
        assert elastic(["resize", "elastic-cb", "--nodes", "4", "--db", url]) == 0
        req = _done(store, job.id, 1, timeout=60)
        assert req.status == "failed"
        found = re.search(r"companion job (\d+) did not start within 3 s", req.message or "")
        assert found, req.message
        comp = int(found.group(1))
        wait("the companion job cancelled", lambda: _gone(slurm, comp), timeout=30)
        assert slurm.job_info(comp).state == "CANCELLED" and slurm.job_info(comp).name == "elastic-cb-companion-1"
        # the job keeps training on the 2 nodes it has
        before = len(_steps(loss))
        wait("more steps", lambda: len(_steps(loss)) >= before + 3, timeout=60, every=0.2)
        assert slurm.job_info(job_id).state == "RUNNING"
        assert store.current_rank_map(job.id).layout == "pp2tp2dp1"
        capsys.readouterr()
        assert elastic(["history", "--db", url, "--json"]) == 0
        (h,) = json.loads(capsys.readouterr().out)
        assert h["status"] == "failed" and h["trigger"] == "resize"
        assert f"companion job {comp} did not start within 3 s" in h["error"]
    finally:
        _cleanup(slurm_testbed, slurm, [job_id, blocker], "elastic-cb-companion-1")


def _cleanup(testbed, slurm, jobs, companion_name: str) -> None:
    ids = [str(j) for j in jobs if j is not None]
    subprocess.run(["scancel", *ids], env={**os.environ, **testbed.env()}, capture_output=True, timeout=30,
                   check=False)  # some may have ended already
    subprocess.run(["scancel", f"--name={companion_name}"], env={**os.environ, **testbed.env()},
                   capture_output=True, timeout=30, check=False)
