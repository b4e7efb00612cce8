"""Live mode: restores from the safety checkpoint count against --max-restarts (torchrun's meaning).

examples/mixer_live.py on tp2 (one node, two devices: no DP replica), --checkpoint-every 2, with device 1
SIGKILLed ($ELASTIC_FAULT=1:step:5) in step 5 of every process started on it. The first death restores
the job from the newest complete checkpoint (step 4's, or step 2's if step 4's background write had not
finished); the restarted worker dies in step 5 again, and with --max-restarts 1
the job ends as failed instead of restoring forever: exactly one restore, then one failed migration and
one line naming the workers, the used-up limit and the checkpoint to resume from. Real processes on the
local backend; the oracle is the database's history and the workers' own logs.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from db import Store

from tests.paths import ROOT


def test_a_worker_that_dies_on_every_start_uses_up_max_restarts(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "launcher.launch", "--backend", "local", "--nnodes", "1", "--gpus-per-node", "2",
           "--layouts", "tp2", "--db", f"sqlite:///{tmp_path}/e.db", "--log-dir", str(tmp_path / "logs"),
           "--poll", "0.1", "--job-name", "rc", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
           "--max-restarts", "1", "--", "python", str(ROOT / "examples" / "mixer_live.py"), "--steps", "8",
           "--step-sleep", "0.2", "--log", str(tmp_path / "steps.log")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ELASTIC_FAULT": "1:step:5"}
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240)
    out = proc.stdout
    assert proc.returncode != 0, out
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("*.log"))
    assert logs.count("fault injection: SIGKILL at step 5") == 2, logs  # the first run and the one restart
    store = Store(f"sqlite:///{tmp_path}/e.db")
    job = store.find_job("rc")
    assert job.state == "failed"
    restored, refused = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    # step 4's checkpoint is written in the background during step 5: the restore takes it or step 2's
    assert (restored.trigger, restored.status) == ("failure", "succeeded") and restored.at_step in (2, 4), restored
    assert restored.error.startswith(f"restored from checkpoint at step {restored.at_step}:"), restored
    ck = next(tmp_path / "ck" / f"step-{s}" for s in (4, 2) if str(tmp_path / "ck" / f"step-{s}") in refused.error)
    want = (f"workers [1] kept failing: --max-restarts 1 is used up by restores from the safety checkpoint; "
            f"raise --max-restarts or fix the worker, then resume from {ck} with `elastic-launch --resume`")
    assert (refused.trigger, refused.status, refused.error) == ("failure", "failed", want), refused
    assert f"cannot recover: {want}; stopping the job" in out, out
    assert store.why_failed(job.id) == want  # what `elastic jobs` and the job page say under the failed job
