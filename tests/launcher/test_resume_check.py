"""`elastic-launch --resume` with no checkpoint to go on from is a one-line usage error before any
worker starts (before: the workers started, and the run failed only once they had registered). The
positive path, a real checkpoint resumed, is tests/launcher/loop/test_checkpoints.py's."""
from __future__ import annotations

from pathlib import Path

import pytest

from launcher.launch import main


def test_resume_with_nothing_to_resume_starts_no_worker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = tmp_path / "started"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(started)!r}, 'w').close()\n")
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-4").mkdir(parents=True)  # a checkpoint whose write never completed (no .metadata)
    argv = ["--backend", "local", "--nnodes", "1", "--gpus-per-node", "1", "--db", f"sqlite:///{tmp_path}/e.db",
            "--job-name", "nothing", "--checkpoint-dir", str(ckpt), "--resume", "--", "python", str(script)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"elastic-launch: error: nothing to resume: job 'nothing' has no checkpoint in the database and "
                   f"{ckpt} holds no complete one (--checkpoint-dir says where to look)"), err
    assert not started.exists()
