"""Two elastic jobs on the Slurm testbed and the dashboard share one history on a real PostgreSQL server:
each `elastic-launch` runs in its own sbatch job (2 nodes x 2 GPUs each: the whole testbed), `elastic
resize` shrinks both to one node, each request is taken by its own job's launcher and answered once, each
migration is recorded once and bit-exact, and the dashboard, reading the same database while the
launchers write, shows both jobs. (The same on the local backend: tests/db/test_shared_postgres.py.)"""
from __future__ import annotations

import sys

import pytest

from db import Store
from launcher.backends.slurm.client import SlurmCommands
from launcher.cli import main as elastic
from tests.dashboard.conftest import SECRET, csrf_of
from tests.launcher.backends.slurm.test_launch_slurm import _gone, wait
from tests.launcher.backends.slurm.test_node_crash import _all_idle
from tests.paths import ROOT
from tests.records import verification_told

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_host, pytest.mark.parametrize("backend", ["postgresql"], indirect=True)]


def _script(name: str, url: str, tmp_path) -> str:
    return f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --gres=gpu:2 --job-name={name} --output={tmp_path}/{name}.out --chdir={tmp_path}
export PYTHONPATH={ROOT}
exec {sys.executable} -m launcher.launch --nnodes 1:2 --gpus-per-node 2 --layouts pp2dp2,pp2dp1 --job-name {name} \\
    --checkpoint-every 0 --db {url} --log-dir {tmp_path}/{name} -- python -m launcher.worker --layers 4 --hidden 64 \\
    --vocab 128 --log-every 0 --steps 40 --step-sleep 0.25
"""


def test_two_slurm_jobs_and_the_dashboard_share_one_postgres_history(slurm_testbed, fresh_url, tmp_path, capsys):
    from dashboard import create_app

    slurm = SlurmCommands(env=slurm_testbed.env())
    wait("every node idle", lambda: _all_idle(slurm_testbed), timeout=120)
    Store(fresh_url).close()  # the schema first (its concurrent creation: tests/db/test_concurrency.py)
    store = Store(fresh_url)
    app = create_app({"DB_URL": fresh_url, "SECRET_KEY": SECRET, "TESTING": True})
    app.extensions["elastic_store"].add_user("ops", "ops-password", "viewer")
    client = app.test_client()
    assert client.post("/login", data={"username": "ops", "password": "ops-password",
                                       "csrf_token": csrf_of(client.get("/login").text)}).status_code == 302
    ids = [slurm.submit(_script(name, fresh_url, tmp_path)) for name in ("sa", "sb")]
    try:
        def on(name: str, nodes: int) -> bool:
            job = store.find_job(name)
            current = store.current_rank_map(job.id) if job else None
            return bool(current and job.last_step and len({e.node for e in current.entries}) == nodes)

        wait("both jobs training on 2 nodes", lambda: on("sa", 2) and on("sb", 2), timeout=180)
        capsys.readouterr()
        for name in ("sa", "sb"):
            assert elastic(["resize", name, "--nodes", "1", "--db", fresh_url]) == 0
        rids = [int(line) for line in capsys.readouterr().out.split()]
        wait("both shrinks answered", lambda: all(store.get_request(r).status != "pending" for r in rids), timeout=120)
        page = client.get("/?show=all").text  # read while the launchers write
        wait("both jobs to end", lambda: all(_gone(slurm, j) for j in ids), timeout=180)
    finally:
        for j in ids:
            try:
                slurm.cancel(j)
            except Exception:
                pass
    for name in ("sa", "sb"):
        job = store.find_job(name)
        assert job is not None and job.state == "finished" and job.slurm_job_id in {str(j) for j in ids}
        assert f'data-job-id="{job.id}"' in page
        reqs = store.list_requests(job.id, limit=100)
        assert [(r.action, r.params, r.status) for r in reqs] == [("shrink", {"nodes": 1}, "done")]
        migs = store.recent_migrations(job.id, limit=100)
        assert [(m.from_layout, m.to_layout, m.status) for m in migs] == [
            ("pp2tp1dp2", "pp2tp1dp1", "succeeded")] and verification_told(migs[0])
    assert store.history_count() == 2 and len({r.taken_by for r in store.list_requests(limit=100)}) == 2
    assert client.get(f"/jobs/{store.find_job('sb').id}").status_code == 200
    store.close()
