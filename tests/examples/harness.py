"""What the example tests share: reading the examples' step logs, waiting on a running job, and the
oracles. The oracles share no code with the launcher or the runtime: the live-mode one compares the
whole state the script saved (DTensor.full_tensor, torch's own gather) before and after every step;
the restart-mode one replays the DDP script's training in one plain process (no DDP, no launcher)."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tests.paths import ROOT


def wait(cond: Callable[[], object], timeout: float, what: str, alive: Callable[[], bool]) -> None:
    """Poll `cond` until true; fail when `alive()` says the job ended first, or after `timeout` s.

    `alive()` is read BEFORE `cond()`: a job that ends right after doing what we wait for (its last
    log line, its own end) must not fail the wait because it ended between the two reads."""
    deadline = time.monotonic() + timeout
    while True:
        running = alive()
        if cond():
            return
        assert running, f"the job (elastic-launch) ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def mixer_rows(path: Path) -> list[tuple[int, str, int, float]]:
    """examples/mixer_live.py's log: (step, layout, samples seen, loss) per step."""
    if not path.exists():
        return []
    return [(int(s), lay, int(n), float(loss))
            for s, loss, lay, n in (line.split() for line in path.read_text().splitlines())]


def ddp_rows(path: Path) -> list[tuple[int, float, int, int]]:
    """examples/ddp_restart.py's log: (step, loss, world size, restart count) per step."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        s, loss, world, restart = line.split()
        out.append((int(s), float(loss), int(world), int(restart)))
    return out


def assert_state_carried(dump: Path, steps: int) -> None:
    """The state step s+1 started from is, bit for bit, the state step s left (on whatever layout)."""
    for s in range(1, steps):
        after, before = torch.load(dump / f"after-{s}.pt"), torch.load(dump / f"before-{s + 1}.pt")
        assert after.keys() == before.keys() and len(after) > 10
        for k in after:
            assert torch.equal(after[k], before[k]), (s, k)


def ddp_reference_losses(steps: int, global_batch: int = 8) -> list[float]:
    """examples/ddp_restart.py's loss curve computed in one process: the same seeds, model, data and
    Adam, the whole global batch at once (what DDP's gradient mean over equal shards amounts to)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(global_batch, 16, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def run_local(tmp_path: Path, launch: list[str], program: list[str],
              drive: Callable[[Callable[[], bool]], None], env: dict[str, str] | None = None,
              check: bool = True, logs: bool = True) -> str:
    """Run `elastic-launch --backend local --nnodes 1:2 --db sqlite:///tmp_path/e.db <launch> -- python
    examples/<program>` (worker logs under tmp_path/logs, this checkout on PYTHONPATH), call
    `drive(alive)` while it runs, then wait for it to end on its own (killed if anything failed first);
    `env` goes on top of this process's environment (e.g. $ELASTIC_FAULT); logs=False: no --log-dir (the
    workers' output goes to elastic-launch's, as a user's first run does).
    Fails when elastic-launch exits non-zero (unless not `check`); returns its output."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "launcher.launch", "--backend", "local", "--nnodes", "1:2", "--db",
           f"sqlite:///{tmp_path}/e.db", *(["--log-dir", str(tmp_path / "logs")] if logs else []), "--poll", "0.1",
           *launch, "--",
           "python", str(ROOT / "examples" / program[0]), *program[1:]]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        drive(lambda: proc.poll() is None)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 or not check, out
    return out


def shrink(tmp_path: Path, job: str, small: str, alive: Callable[[], bool]) -> None:
    """For a job run by run_local that logs like mixer_live.py to tmp_path/steps.log: after 3 steps `elastic
    resize` it to 1 node; return once 2 steps ran on layout `small`."""
    from launcher.cli import main as elastic

    log = tmp_path / "steps.log"
    wait(lambda: len(mixer_rows(log)) >= 3, 120, "3 steps on 2 nodes", alive)
    assert elastic(["resize", job, "--nodes", "1", "--db", f"sqlite:///{tmp_path}/e.db"]) == 0
    wait(lambda: any(r[1] == small for r in mixer_rows(log)), 120, f"a step on {small}", alive)
    shrunk = next(r[0] for r in mixer_rows(log) if r[1] == small)
    wait(lambda: mixer_rows(log)[-1][0] >= shrunk + 2, 120, f"two steps on {small}", alive)


def shrink_and_grow(tmp_path: Path, job: str, layouts: str, small: str, script: str, args: list[str],
                    gpus_per_node: int = 2, launch: list[str] = (), env: dict[str, str] | None = None,
                    then: Callable[[Callable[[], bool]], None] | None = None) -> list[tuple[int, str, int, float]]:
    """Run examples/`script` (a live-mode one that logs like mixer_live.py to its --log, here
    tmp_path/steps.log) with `args` under `elastic-launch --backend local` on 2 nodes with --layouts
    `layouts` (and `launch`, `env`: see run_local); after 3 steps `elastic resize` to 1 node, after 2 steps
    on layout `small` back to 2, once a step ran on the grown layout `then(alive)` if given. The script's
    --step-sleep (time for each resize to land before the last step) applies only until then (its
    --sleep-while file is removed): the steps left run at full speed. Returns the log's rows (mixer_rows)
    once the job ended; fails if elastic-launch exits non-zero."""
    from launcher.cli import main as elastic

    log, pace = tmp_path / "steps.log", tmp_path / "pace"
    pace.touch()

    def drive(alive: Callable[[], bool]) -> None:
        shrink(tmp_path, job, small, alive)
        shrunk = max(r[0] for r in mixer_rows(log) if r[1] == small)
        assert elastic(["resize", job, "--nodes", "2", "--db", f"sqlite:///{tmp_path}/e.db"]) == 0
        wait(lambda: any(r[0] > shrunk and r[1] != small for r in mixer_rows(log)), 120, "a step after the grow",
             alive)
        if then is not None:
            then(alive)
        pace.unlink()

    run_local(tmp_path, ["--gpus-per-node", str(gpus_per_node), "--layouts", layouts, "--job-name", job, *launch],
              [script, "--log", str(log), "--sleep-while", str(pace), *args], drive, env)
    return mixer_rows(log)


def kill_worker(tmp_path: Path, device: int) -> None:
    """SIGKILL the worker process of `device` of the job run by run_local in `tmp_path` (found in /proc: a
    worker forked by the local backend's fork server is named elastic-dev<device> and works in tmp_path; one
    started afresh has tmp_path/steps.log on its command line and ELASTIC_DEVICE=<device> in its
    environment): a real death."""
    import os
    import signal

    log, mark = str(tmp_path / "steps.log").encode(), f"ELASTIC_DEVICE={device}".encode()
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            forked = (proc / "comm").read_text().strip() == f"elastic-dev{device}" and \
                Path(os.readlink(proc / "cwd")) == tmp_path.resolve()
            if forked or (log in (proc / "cmdline").read_bytes()
                          and mark in (proc / "environ").read_bytes().split(b"\0")):
                os.kill(int(proc.name), signal.SIGKILL)
                return
        except OSError:  # ended meanwhile, or not ours to read
            continue
    raise AssertionError(f"no worker process of device {device} under {tmp_path}")
