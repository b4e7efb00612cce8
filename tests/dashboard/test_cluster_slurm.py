"""The cluster view against the real Slurm testbed, in a real Chromium: one plain `sbatch` job and one
elastic job (elastic-launch with real workers) share node n2; /cluster shows both on the right GPUs
and the stranded ones; preempting n2 from the page moves the elastic job off it, the page follows
without a reload (live events), and the job's timeline shows the migration.

Run under the locks: `flock /tmp/elastic-slurm.lock flock /tmp/elastic-heavy.lock
pytest -m "slurm and browser" tests/dashboard/test_cluster_slurm.py` (about 1-2 minutes).
It cancels any job left on the testbed first: under the lock, nothing else may run there.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from dashboard import create_app
from db import Store
from tests.dashboard.conftest import PASSWORDS, SECRET
from tests.dashboard.slurm_oracle import gpu_indices as _gpu_idx, slurm as _slurm
from tests.dashboard.test_browser import _shot, browser, page  # noqa: F401  (fixtures)
from tests.launcher.conftest import slurm_testbed  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_host, pytest.mark.browser]
from tests.paths import ROOT
WAIT = 180.0


def _wait(what: str, fn: Any, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _open(url: str) -> Store | None:
    try:
        store = Store(url, create=False)
        store.list_jobs()
        return store
    except Exception:
        return None


@pytest.fixture
def cluster(slurm_testbed: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:  # noqa: F811
    env = slurm_testbed.env()
    left = _slurm(env, "squeue", "-h", "-o", "%i").split()
    if left:
        _slurm(env, "scancel", *left)
        _wait("leftover jobs to end", lambda: not _slurm(env, "squeue", "-h", "-o", "%i").strip(), 60)
    url = f"sqlite:///{tmp_path}/e.db"
    plain = _slurm(env, "sbatch", "--parsable", "-J", "plain-sbatch", "-N1", "-w", "n2", "--gres=gpu:1",
                   f"--output={tmp_path}/plain.out", "--wrap", "sleep 600").strip()
    script = f"""#!/bin/bash
#SBATCH --nodes=2 --nodelist=n1,n2 --ntasks-per-node=2 --gres=gpu:2 --job-name=elastic-cv --output={tmp_path}/batch.out --chdir={tmp_path}
export PYTHONPATH={ROOT}
exec {sys.executable} -m launcher.launch --nnodes 1:2 --gpus-per-node 2 --layouts pp2tp2,pp2 --db {url} \\
    --log-dir {tmp_path}/logs -- python -m launcher.worker --layers 4 --hidden 128 --vocab 512 --step-sleep 0.1 --log-every 0
"""
    (tmp_path / "job.sh").write_text(script)
    elastic = _slurm(env, "sbatch", "--parsable", str(tmp_path / "job.sh")).strip()
    server = None
    try:
        store = _wait("the launcher's database", lambda: _open(url), 60)
        job = _wait("the elastic job registered", lambda: store.find_job("elastic-cv"))
        _wait("its first placement", lambda: store.current_rank_map(job.id))
        for role in PASSWORDS:
            store.add_user(role, PASSWORDS[role], role)
        app = create_app({"DB_URL": url, "SECRET_KEY": SECRET, "CLUSTER_SOURCE": "slurm", "SLURM_ENV": env,
                          "THREADS": 8, "SSE_FEED_SECONDS": 0.2})
        from waitress.server import create_server

        server = create_server(app, host="127.0.0.1", port=0, threads=8)
        threading.Thread(target=server.run, daemon=True).start()
        yield {"env": env, "plain": plain, "elastic": elastic, "store": store, "job": job,
               "base": f"http://127.0.0.1:{server.effective_port}", "tmp": tmp_path}
    finally:
        if server is not None:
            server.close()
        subprocess.run(["scancel", plain, elastic], env={**os.environ, **env}, capture_output=True)


def test_cluster_page_shows_both_jobs_and_preempt_moves_the_elastic_one_live(cluster: dict[str, Any],
                                                                            page: Any) -> None:  # noqa: F811
    env, store, job, base = cluster["env"], cluster["store"], cluster["job"], cluster["base"]
    page.set_default_timeout(20_000)
    refused: list[str] = []  # CSP violations (script-src 'self': no inline script, no eval)
    page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
    page.goto(f"{base}/cluster")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", PASSWORDS["admin"])
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/cluster")
    assert page.locator("#cluster-panels").get_attribute("data-source") == "slurm"

    # the plain job on the GPU Slurm gave it; the elastic ranks on the GPU indices of their job
    plain_idx = _gpu_idx(env, cluster["plain"])
    assert list(plain_idx) == ["n2"]
    for gpu in plain_idx["n2"]:
        cell = page.locator(f'tr[data-node="n2"] td[data-gpu="{gpu}"]')
        assert cell.get_attribute("data-kind") == "job" and cell.get_attribute("data-job") == cluster["plain"]
    elastic_idx = _gpu_idx(env, cluster["elastic"])
    ranks = store.current_rank_map(job.id)
    assert {e.node for e in ranks.entries} == {"n1", "n2"}
    for e in ranks.entries:
        cell = page.locator(f'tr[data-node="{e.node}"] td[data-gpu="{elastic_idx[e.node][e.gpu]}"]')
        assert cell.get_attribute("data-kind") == "elastic" and cell.get_attribute("data-rank") == str(e.virtual_rank)
        assert f"pp{e.pp} tp{e.tp} dp{e.dp}" in cell.inner_text()
    # stranded: the idle GPUs of n1 and n2 (n3, n4 are whole free nodes)
    gpus = {n: int(g) for n, g in (line.split() for line in _slurm(env, "sinfo", "-h", "-N", "-o", "%N %G").replace(
        "gpu:", "").splitlines())}
    used = {"n1": len(elastic_idx["n1"]), "n2": len(elastic_idx["n2"]) + len(plain_idx["n2"])}
    stranded = sum(gpus[n] - used[n] for n in used)
    assert page.locator("#stranded strong").inner_text() == str(stranded)
    assert page.locator("#free-nodes strong").inner_text() == str(len(gpus) - 2)
    page.wait_for_selector('body[data-live-state="open"]')
    _shot(page, "cluster-before.png", cluster["tmp"])

    # preempt n2: the dry run names the elastic job and the bytes, the plain job stays; confirm
    page.evaluate("window.__sameDocument = true")
    page.check('#preempt-pick input[value="n2"]')
    page.click("#preempt-pick button[name=preview]")
    plan = page.wait_for_selector(f'#preempt-plan .preview-job[data-elastic-job="{job.id}"]')
    assert plan.get_attribute("data-refused") == "no"
    assert int(page.locator("#preempt-plan .bytes-moved").get_attribute("data-bytes")) > 0
    assert page.locator("#preempt-plan .released").inner_text() == "n2"  # what Slurm takes back, checked below
    assert page.locator("#preempt-plan .stays").count() == 0
    assert f"Slurm job {cluster['plain']} plain-sbatch on n2 is not elastic" in page.locator("#preempt-plan").inner_text()
    page.click(f'#preempt-plan button[value="{job.id}"]')
    page.wait_for_selector(f"#preempt-result-{job.id} [data-request-id]")

    # the launcher moves the job off n2; the page follows without a reload
    page.wait_for_selector('tr[data-node="n2"] td[data-kind="elastic"]', state="detached", timeout=WAIT * 1000)
    # ... and once Slurm took n2 back from the job, its GPUs there show idle (stranded beside the plain job)
    page.wait_for_selector('tr[data-node="n2"] td[data-kind="held"]', state="detached", timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True
    assert page.locator(f'tr[data-node="n2"] td[data-job="{cluster["plain"]}"]').count() == len(plain_idx["n2"])
    assert page.locator('tr[data-node="n1"] td[data-kind="elastic"]').count() == 2
    _wait("the migration in the live log", lambda: "succeeded" in page.locator("#live-log").inner_text(), 30)
    (req,) = store.list_requests(job.id)
    assert req.status == "done", req.message
    assert _gpu_idx(env, cluster["elastic"]).keys() == {"n1"}  # Slurm took n2 back from the job
    _shot(page, "cluster-after-preempt.png", cluster["tmp"])

    # the timeline shows the migration (with its pause, or its duration when none was measured)
    page.goto(f"{base}/jobs/{job.id}/timeline")
    (mig,) = store.recent_migrations(job.id)
    band = page.locator("#layouts-chart g.band").first.get_attribute("data-label")
    assert band.startswith(f"#{mig.id} pp2tp2dp1→pp2tp1dp1") and (" pause " in band or " duration " in band)
    assert page.locator(f'#timeline-migrations tr[data-migration="{mig.id}"]').count() == 1
    assert int(page.locator("#loss-chart path.line").get_attribute("data-points")) > 0
    _shot(page, "timeline.png", cluster["tmp"])
    assert refused == []
