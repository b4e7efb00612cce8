"""/cluster on the real testbed of whichever Slurm release runs it (the host's 22.05, or 24.11 / 26.05 in their
roots: `elastic testbed run --slurm R -- pytest -m slurm_core`): every node and every job that holds GPUs is
on the page, each job on the GPU indices Slurm gave it. The oracle is `scontrol -d show job` (text, read by
its own regular expression: tests/dashboard/slurm_oracle.py), not the JSON the dashboard reads. No browser: what differs between
releases is what Slurm prints, and the page is rendered by Flask's test client.
"""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from dashboard import create_app
from dashboard.slurm_reader import read_slurm
from tests.dashboard.conftest import SECRET, login
from tests.dashboard.slurm_oracle import gpu_indices as _indices, slurm as _sh
from tests.launcher.conftest import slurm_testbed  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_core]


def test_the_cluster_page_shows_every_node_and_job_of_this_release(slurm_testbed, db_url) -> None:
    env = slurm_testbed.env()
    plain = _sh(env, "sbatch", "--parsable", "--job-name=every-plain", "--output=/dev/null", "--nodes=2",
                "--gres=gpu:3", "--wrap=sleep 120").strip()
    het = _sh(env, "sbatch", "--parsable", "--job-name=every-het", "--output=/dev/null", "--nodes=1", "--gres=gpu:1",
              ":", "--nodes=1", "--gres=gpu:2", "--wrap=sleep 120").strip()
    try:
        deadline = time.monotonic() + 60
        while "PENDING" in _sh(env, "squeue", "-h", "-o", "%T", "-j", f"{plain},{het}") and time.monotonic() < deadline:
            time.sleep(0.3)
        snapshot = read_slurm(env)
        assert [n.name for n in snapshot.nodes] == list(slurm_testbed.nodes)
        assert all(n.gpus == 4 and n.partitions == ("debug",) for n in snapshot.nodes)
        jobs = {j.job_id: j for j in snapshot.jobs}
        assert jobs[plain].gpus == _indices(env, plain) and len(jobs[plain].gpus) == 2
        parts = [j for j in snapshot.jobs if j.het_job_id == het]
        assert sorted(p.het_job_offset for p in parts) == [0, 1]
        for part in parts:
            assert part.gpus == _indices(env, part.job_id)
        app = create_app({"DB_URL": db_url, "SECRET_KEY": SECRET, "CLUSTER_SOURCE": "slurm", "SLURM_ENV": env})
        client = app.test_client()
        login(client, "viewer")
        page = client.get("/cluster")
        assert page.status_code == 200, page.text[-2000:]
        for name in [*slurm_testbed.nodes, "every-plain", "every-het"]:
            assert name in page.text, name
        # each job's Slurm user, which a site that keeps jobs private shows its owner alone (sbatch ran as root)
        assert {j.user for j in [jobs[plain], *parts]} == {"root"}
        app.config["PRIVATE_JOBS"] = True
        private = client.get("/cluster").text
        assert "every-plain" not in private and "every-het" not in private and 'data-kind="other"' in private
    finally:
        subprocess.run(["scancel", plain, het], env={**os.environ, **env}, capture_output=True)
