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

ROOT = Path(__file__).resolve().parents[2]


def wait(cond: Callable[[], object], timeout: float, what: str, alive: Callable[[], bool]) -> None:
    """Poll `cond` until true; fail when `alive()` says the job ended first, or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert alive(), f"the job (elastic-launch) ended while waiting for {what}"
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
