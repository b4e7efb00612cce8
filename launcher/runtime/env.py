"""What a worker reads from the environment elastic-launch started it in (launcher.wire.env names it):
its device, the event it starts at, where and how often it writes safety checkpoints. The runtime and
the reference worker read it the same way, so the names' meaning is spelled once."""
from __future__ import annotations

import os

from launcher.wire.env import (ENV_CKPT_DIR, ENV_CKPT_EVERY, ENV_DEVICE, ENV_FIRST_DEVICE, ENV_FIRST_EVENT,
                               ENV_GPUS_PER_NODE, ENV_LOCAL_ID, ENV_NODE_INDEX, ENV_RUNTIME_LOG)


def device_from_env(env=os.environ) -> tuple[int, int, int]:
    """(device id, local rank, gpus per node) of this worker."""
    gpn = int(env.get(ENV_GPUS_PER_NODE, "1"))
    local = int(env.get(ENV_LOCAL_ID, env.get("SLURM_LOCALID", "0")))
    if ENV_DEVICE in env:
        return int(env[ENV_DEVICE]), local, gpn
    if ENV_FIRST_DEVICE in env:  # one srun step per node: the node's first device id plus the task's index
        return int(env[ENV_FIRST_DEVICE]) + local, local, gpn
    if ENV_NODE_INDEX not in env:
        raise RuntimeError(f"neither ${ENV_DEVICE} nor ${ENV_NODE_INDEX} is set: start workers with elastic-launch")
    return int(env[ENV_NODE_INDEX]) * gpn + local, local, gpn


def first_event_from_env(env=os.environ) -> int:
    """The first event this worker handles (a worker started by a grow skips the ones before it)."""
    return int(env.get(ENV_FIRST_EVENT, "0"))


def checkpoints_from_env(env=os.environ) -> tuple[str | None, int]:
    """(folder of the job's checkpoints or None, safety checkpoint every N steps: 0 never, and without a folder)."""
    folder = env.get(ENV_CKPT_DIR) or None
    return folder, int(env.get(ENV_CKPT_EVERY, "0") or 0) if folder else 0


def runtime_log_from_env(device: int, env=os.environ):
    """Where the runtime's own lines go: a text file of their own (the workers' output goes to the launcher's,
    whose user wants one line per migration, not every worker's), else None: the worker's stderr."""
    folder = env.get(ENV_RUNTIME_LOG)
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    return open(os.path.join(folder, f"runtime-dev{device}.log"), "a", buffering=1)
