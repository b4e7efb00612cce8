"""Consistent cuts for live mode (launcher.runtime), the same protocol as the reference worker's.

Every optimizer step commits all-or-nothing: a pre-hook on the script's optimizer votes on
`c/<world>/<finished steps>` (launcher.runtime.vote) before the step is applied, so
either every rank of the training world applies it or none does. When a worker dies, the launcher
sets `abort/<world>`; the survivors' next collective fails (their sockets are cut, see
launcher.runtime.sockets) or their vote loses. The failed step is abandoned inside `job.guard()`: the
survivors keep the state of the last committed step, take back the step count and the registered
objects' state of that boundary, and wait for the launcher's recovery event.

What counts as a peer's failure (not a bug in the script): this module's StepAborted, a world that
could not form, torch.distributed's own errors, or any RuntimeError while the launcher has marked the
world aborted (gloo reports a closed socket as a plain RuntimeError); the launcher sets the mark within
a poll of seeing the process end, so a RuntimeError waits up to `ABORT_WAIT_S` for it. A peer whose node
crashed is not seen ending: the worker posts a suspicion and the launcher checks the nodes before it
answers (is_peer_failure; launcher.loop.probe).

Fault injection for tests: $ELASTIC_FAULT = "DEVICE:POINT[:N]", POINT one
of `step` (SIGKILL in step N, after the gradients, before the commit vote), `round` (in a migration's
transfer, before its window N: migrate.transfer's rounds of messages; a process with fewer windows lives), `commit` (after a migration's transfer, before its commit vote), `committed` (right after
the migration committed, before reporting), `ckpt` (live mode only: inside the background write of the
first safety checkpoint of a step >= N, after this rank's files, before the metadata; launcher.runtime.ckpt).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from launcher.wire.control import Control, WorldAborted

ABORT_WAIT_S = 10.0
PROBE_MARGIN_S = 10.0  # beyond the launcher's announced check of the nodes: its answer may take a poll or two


class StepAborted(RuntimeError):
    """The step was not committed: some worker of the training world failed it."""


def is_peer_failure(exc: BaseException, ctl: Control, world: str | None,
                    on_suspect: Callable[[], None] = lambda: None, wait_s: float = ABORT_WAIT_S) -> bool:
    """True when `exc` comes from another worker's failure (see the module docstring).

    A plain RuntimeError with no abort mark yet may be a peer whose whole node is gone, which no launcher
    sees at once (on Slurm its step just goes quiet): `on_suspect()` runs (cut this worker's sockets, so
    the peers blocked on it fail and say so too), the suspicion is posted (Control.suspect), and the
    launcher's answer is awaited: the abort mark (a peer failed: True), "clear" (none did: False), or the
    seconds its check of the nodes may take, which extend the wait beyond `wait_s`."""
    import torch.distributed as dist

    if isinstance(exc, (StepAborted, WorldAborted, dist.DistError)):
        return True
    if not isinstance(exc, RuntimeError) or world is None:
        return False
    if ctl.world_aborted(world):
        return True
    on_suspect()
    if ctl.device is not None:
        ctl.suspect(world, ctl.device, f"{type(exc).__name__}: {exc}")
    deadline, extended = time.monotonic() + wait_s, False
    while True:
        if ctl.world_aborted(world):
            return True
        verdict = ctl.probe(world)
        if verdict == "clear":
            return False
        if verdict is not None and not extended:
            deadline, extended = max(deadline, time.monotonic() + float(verdict) + PROBE_MARGIN_S), True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def fault_for(device: int, env=os.environ) -> tuple[str, int | None] | None:
    """Fault injection for tests: $ELASTIC_FAULT = "DEVICE:POINT[:N]" -> (POINT, N) on that device, else None."""
    parts = env.get("ELASTIC_FAULT", "").split(":")
    if len(parts) < 2 or not parts[0].isdigit() or int(parts[0]) != device:
        return None
    return parts[1], int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None


def die_at(fault: tuple[str, int | None] | None, point: str, n: int | None = None,
           log: Callable[[str], None] = print) -> None:
    """SIGKILL this process when `fault` names `point` (and its N, if any, is reached by `n`)."""
    if fault and fault[0] == point and (fault[1] is None or n is None or n >= fault[1]):
        log(f"fault injection: SIGKILL at {point} {n}")
        os.kill(os.getpid(), 9)


def install_commit(optimizer, vote) -> object:
    """Make `optimizer.step()` apply only after `vote()` returned (it raises StepAborted otherwise);
    returns the hook handle."""
    return optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: vote())
