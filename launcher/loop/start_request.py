"""The start request: what starting a node's workers runs (command lines and environment), built once.

`elastic-launch --dry-run` prints it and the launcher runs it, so the dry run shows exactly what a
real start runs, environment included (as TorchX's dry run returns the very request `schedule`
submits). The one thing a dry run cannot know is the control plane's port when it is picked at
start (--master-port 0): there it prints PORT.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.wire.env import (ENV_CKPT_DIR, ENV_CKPT_EVERY, ENV_FIRST_EVENT, ENV_GPUS_PER_NODE, ENV_RUNTIME_LOG,
                               ENV_STORE)
from launcher.backends import NodeBackend
from launcher.options import Options, default_checkpoint_dir


def checkpoint_dir(opts: Options, db_url: str | None) -> str:
    """The job's checkpoint folder, absolute: --checkpoint-dir, else next to a SQLite database."""
    return str(Path(opts.checkpoint_dir or default_checkpoint_dir(db_url, opts.job_name)).resolve())


@dataclass(frozen=True)
class StartRequest:
    """The environment and command every worker of the job starts with."""

    command: tuple[str, ...]
    master_addr: str
    port: int | None  # None: not bound yet (a dry run with --master-port 0)
    gpus_per_node: int
    checkpoint_dir: str
    checkpoint_every: int
    runtime_log: str | None = None  # ENV_RUNTIME_LOG: where the runtime's lines go when no file takes the output

    @classmethod
    def for_job(cls, opts: Options, db_url: str | None, port: int | None, backend: NodeBackend) -> "StartRequest":
        folder = checkpoint_dir(opts, db_url)
        first = backend.allocation()[0]
        captured = backend.output_files(first, range(backend.gpus_on(first)))  # --log-dir: the worker log files
        return cls(tuple(opts.command), opts.master_addr, port, opts.gpus_per_node, folder, opts.checkpoint_every,
                   None if captured else f"{folder}.logs")

    def env(self, first_event: int) -> dict[str, str]:
        """Every worker's environment before the backend adds its node's and device's variables;
        `first_event` is the first control-plane event the workers handle (0 at the start)."""
        port = "PORT" if self.port is None else str(self.port)
        return {ENV_STORE: f"{self.master_addr}:{port}", ENV_GPUS_PER_NODE: str(self.gpus_per_node),
                ENV_FIRST_EVENT: str(first_event), "MASTER_ADDR": self.master_addr, "MASTER_PORT": port,
                "PYTHONUNBUFFERED": "1", ENV_CKPT_DIR: self.checkpoint_dir,
                ENV_CKPT_EVERY: str(self.checkpoint_every), **({ENV_RUNTIME_LOG: self.runtime_log}
                                                               if self.runtime_log else {})}

    def commands(self, backend: NodeBackend, nodes: Sequence[str], first_event: int = 0) -> list[list[str]]:
        """The command lines that start the workers of `nodes` (indices from the backend's allocation)."""
        alloc = backend.allocation()
        return [cmd for n in nodes for cmd in backend.commands_for_start(n, alloc.index(n), self.env(first_event),
                                                                         self.command)]
