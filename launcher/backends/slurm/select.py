"""Choosing the Slurm client: pyslurm when it was built for the cluster's Slurm, else the command-line tools.

Its own module above both clients, so neither imports the other to choose.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from launcher.backends.slurm.client import Runner, SlurmClient, SlurmCommands, SlurmError
from launcher.backends.slurm.parse import parse_slurm_version
from launcher.backends.slurm.pyslurm import PyslurmBackend


def select_backend(env: Mapping[str, str] | None = None, runner: Runner | None = None,
                   importer: Callable[[str], Any] | None = None) -> SlurmClient:
    """PyslurmBackend if pyslurm imports and matches the cluster's Slurm major.minor,
    else SlurmCommands. A mismatched pyslurm would speak the wrong RPC protocol."""
    commands = SlurmCommands(env=env, runner=runner)
    try:
        pyslurm = (importer or __import__)("pyslurm")
        lib_version = parse_slurm_version(str(getattr(pyslurm, "__version__", "")))
        cluster_version = commands.version()
    except (ImportError, ValueError, SlurmError):
        return commands
    if lib_version != cluster_version:
        return commands
    return PyslurmBackend(pyslurm, env=env, runner=runner)
