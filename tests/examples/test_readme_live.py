"""The smallest live-mode script of the README, taken from the README itself, runs under elastic-launch
(2 devices, TP 2) and its job is recorded as live and finished."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from db import Store

from tests.paths import ROOT


def test_readme_live_script_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run your own training script", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.splitlines()) <= 32
    (tmp_path / "train.py").write_text(code.replace("until=1000", "until=3"))
    url = f"sqlite:///{tmp_path}/e.db"
    r = subprocess.run([sys.executable, "-m", "launcher.launch", "--backend", "local", "--nnodes", "1",
                        "--gpus-per-node", "2", "--layouts", "tp2dp1", "--db", url, "--job-name", "readme",
                        "--poll", "0.05", "--", "python", "train.py"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=180)
    assert r.returncode == 0, r.stderr
    job = Store(url).find_job("readme")
    assert (job.state, job.mode, job.layout, job.last_step) == ("finished", "live", "pp1tp2dp1", 3)
