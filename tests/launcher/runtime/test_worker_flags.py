"""The reference worker (python -m launcher.worker) on the runtime API: two real worker processes of one
job given different model flags. The first one's model is the job's; the second exits with status 2 and
one line that names both models and says to give every worker the same flags, before it trains. A worker
given an $ELASTIC_GLOO_NICE (launcher.runtime.threads) or $ELASTIC_CMA (migrate.cma) it cannot use exits the
same way, before it says hello."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.wire import control as C
from launcher.wire.env import ENV_DEVICE, ENV_GPUS_PER_NODE, ENV_LOCAL_ID, ENV_STORE

from tests.paths import ROOT


def _worker(ctl: C.Control, device: int, layers: int, tmp_path: Path, **extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), ENV_STORE: ctl.address, ENV_DEVICE: str(device),
           ENV_GPUS_PER_NODE: "2", ENV_LOCAL_ID: str(device), **extra}
    return subprocess.Popen([sys.executable, "-m", "launcher.worker", "--layers", str(layers), "--hidden", "64",
                             "--vocab", "128"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / f"dev{device}.err", "w"), text=True)


def test_a_worker_whose_model_flags_differ_is_refused_with_one_line(tmp_path: Path) -> None:
    ctl = C.Control("127.0.0.1", 0, server=True)
    first = _worker(ctl, 0, 4, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while ctl.model() is None:  # the first worker offered its model: it is the job's
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "dev0.err").read_text()
            time.sleep(0.1)
        second = _worker(ctl, 1, 8, tmp_path)
        assert second.wait(timeout=120) == 2
        err = (tmp_path / "dev1.err").read_text().strip().splitlines()
        assert len(err) == 1 and "give every worker the same model flags" in err[0], err
        assert "'layers': 8" in err[0] and "'layers': 4" in err[0], err
        assert not ctl.ready([1]) and first.poll() is None  # refused before it registered; the first waits on
    finally:
        first.kill()
        first.wait()


@pytest.mark.parametrize("var,value,says", [
    ("ELASTIC_GLOO_NICE", "lowest", "$ELASTIC_GLOO_NICE must be a whole number from 0"),
    ("ELASTIC_CMA", "lowest", "$ELASTIC_CMA must be 1"),
])
def test_a_worker_given_a_bad_environment_setting_is_refused_with_one_line(tmp_path: Path, var, value, says) -> None:
    ctl = C.Control("127.0.0.1", 0, server=True)
    worker = _worker(ctl, 0, 4, tmp_path, **{var: value})
    assert worker.wait(timeout=120) == 2
    err = (tmp_path / "dev0.err").read_text().strip().splitlines()
    assert len(err) == 1 and says in err[0] and f"'{value}'" in err[0], err
    assert ctl.model() is None and not ctl.hellos([0])  # refused before it said hello or offered its model
