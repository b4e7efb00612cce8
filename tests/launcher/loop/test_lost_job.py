"""A job nobody drives is shown as such, and `elastic-launch --resume` takes it over: the launcher of a live
job (examples/mixer_live.py, tp2dp2 on 2 nodes x 2 devices, safety checkpoints every 2 steps, real
processes) is killed with SIGKILL; its workers end, the row stays `running`, and once its heartbeat is
older than ELASTIC_LOST_AFTER_S `elastic jobs` says `lost` with the command that resumes it. A new
launcher with --resume goes on as the same job from the newest complete checkpoint to the last step."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from db import Store
from launcher.cli import main as elastic
from tests.examples.harness import mixer_rows, wait
from tests.paths import ROOT


def _launch(tmp_path: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launcher.launch", "--backend", "local", "--nnodes", "2", "--gpus-per-node", "2",
           "--layouts", "tp2dp2,tp2dp1", "--db", f"sqlite:///{tmp_path}/e.db", "--log-dir", str(tmp_path / "logs"),
           "--poll", "0.1", "--job-name", "orphan", "--checkpoint-every", "2", "--checkpoint-dir",
           str(tmp_path / "ck"), *extra, "--", "python", str(ROOT / "examples" / "mixer_live.py"), "--steps", "14",
           "--log", str(tmp_path / "steps.log"), "--step-sleep", "0.2"]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_job_whose_launcher_died_is_lost_then_taken_over(tmp_path: Path, capsys, monkeypatch) -> None:
    first = _launch(tmp_path)
    try:
        wait(lambda: list((tmp_path / "ck").glob("step-4")), 240, "a complete checkpoint of step 4",
             lambda: first.poll() is None)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    store = Store(f"sqlite:///{tmp_path}/e.db")
    job = store.find_job("orphan")
    assert job.state == "running" and job.heartbeat_at is not None  # nothing recorded the launcher's death
    deadline = time.monotonic() + 60  # its workers end without it (they lose the control plane)
    while subprocess.run(["pgrep", "-f", str(tmp_path / "steps.log")], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "workers outlived their launcher"
        time.sleep(0.5)

    monkeypatch.setenv("ELASTIC_LOST_AFTER_S", "1")
    time.sleep(1.5)
    assert elastic(["jobs", "--db", f"sqlite:///{tmp_path}/e.db", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["state"] == "lost" and row["lost_since"] and "elastic-launch --resume --job-name orphan" in row["why"]
    assert elastic(["jobs", "--db", f"sqlite:///{tmp_path}/e.db"]) == 0
    assert "lost: no heartbeat from its launcher since" in capsys.readouterr().out

    second = _launch(tmp_path, "--resume")
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out[-3000:]
    assert "taking over job orphan (id 1)" in out
    taken = store.find_job("orphan")
    assert (taken.id, taken.state) == (job.id, "finished") and len(store.list_jobs()) == 1
    steps = [r[0] for r in mixer_rows(tmp_path / "steps.log")]
    assert steps[-1] == 14 and set(range(1, 15)) <= set(steps)  # every step ran; those after the checkpoint again
