"""`elastic testbed up|down|status [--slurm 24.11] [--root DIR] [--gpus 4,4,2,2]`, `elastic testbed crash|revive
NODE`, `elastic testbed run --slurm 26.05 -- CMD`: the local Slurm cluster, and a node crash on it (for trying what
a job survives).

`--slurm` picks the release: 22.05 is the host's own (Debian 12); 24.11 and 26.05 run in a Debian root
built once from Debian's packages (launcher.testbed.roots), where `run` runs a command -- a shell, an sbatch,
the Slurm tests -- with the project at its own path.

The default shape is 4 nodes x 4 GPUs. `up --gpus 4,4,2,2` brings up nodes of different GPU counts
with a partition per count (gpu4, gpu2) besides `debug`; a later plain `up` brings the default back.
`status` and `down` act on whatever shape is running.

`up` ends with an `export SLURM_CONF=...` line so `eval "$(elastic testbed up)"`
points the shell's Slurm commands at the testbed; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from launcher.errors import UsageError
from launcher.testbed.cluster import Testbed
from launcher.testbed.config import DEFAULT_GPUS, DEFAULT_ROOT, parse_gpus
from launcher.testbed.errors import TestbedError
from launcher.testbed.roots import (
    SLURM_VERSIONS,
    SlurmRoot,
    check_version,
    inside_root,
    processes_in,
    root_path,
    runs_natively,
)

ACTIONS = ("up", "down", "status", "crash", "revive", "run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", default="status", choices=ACTIONS,
                        help="bring the cluster up, down, or report its state (the default: which releases run, "
                             "their nodes); `crash NODE` kills a node's slurmd, "
                             "step daemons and tasks as a crash would, `revive NODE` starts its slurmd again; "
                             "`run -- CMD ...` runs a command where the --slurm release's clients are (its root)")
    parser.add_argument("node", nargs="?", metavar="NODE", help="crash/revive only: the node, e.g. n2")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    _add_options(parser)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slurm", default=None, metavar="RELEASE", choices=SLURM_VERSIONS,
                        help=f"the Slurm release: {SLURM_VERSIONS[0]} (this host's, the default) or "
                             f"{', '.join(SLURM_VERSIONS[1:])} (in a Debian root built on first use, ~2 min)")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                        help=f"folder holding all testbed state (default {DEFAULT_ROOT})")
    parser.add_argument("--gpus", default=None, metavar="G,G,...",
                        help="up only: GPUs of each node, e.g. 4,4,2,2 (default "
                             f"{','.join(map(str, DEFAULT_GPUS))}); uneven counts add partitions gpu4, gpu2, ...")


def _split_rest(args: argparse.Namespace) -> list[str]:
    """The options argparse left after the positionals (REMAINDER keeps `-- CMD` whole), parsed into
    `args`; returns the command after `--`."""
    rest = list(args.rest)
    if args.action == "run" and args.node is not None:  # `run -- CMD`: argparse took `--` and CMD's first word
        command, args.node = [args.node, *rest], None
        return command
    head, command = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    options = argparse.ArgumentParser(prog=f"elastic testbed {args.action}", add_help=False)
    _add_options(options)
    options.add_argument("more", nargs="*")
    parsed = options.parse_args(head)
    for name in ("slurm", "gpus"):
        if getattr(parsed, name) is not None:
            setattr(args, name, getattr(parsed, name))
    if parsed.root != DEFAULT_ROOT:
        args.root = parsed.root
    return parsed.more + command


def run(args: argparse.Namespace) -> int:
    args.rest = _split_rest(args)
    if args.action == "run":
        return _run_command(args)
    if not runs_natively(args.slurm):
        return _in_root(args)
    if args.rest:
        raise UsageError(f"`elastic testbed {args.action}` takes no command (only `run -- CMD` does)")
    root: Path = args.root
    if root.exists() and not root.is_dir():
        raise UsageError(f"--root {root} exists and is not a folder")
    if args.gpus is not None and args.action != "up":
        raise UsageError(f"--gpus applies to `up` only; `{args.action}` acts on the shape that is running")
    try:
        gpus = parse_gpus(args.gpus) if args.gpus is not None else DEFAULT_GPUS
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if (args.node is not None) != (args.action in ("crash", "revive")):
        raise UsageError("crash and revive take one NODE (e.g. `elastic testbed crash n2`); the others take none")
    if args.action == "up" and os.geteuid() != 0:
        raise UsageError("the testbed starts slurmd, munged and MariaDB and must run as root")
    testbed = Testbed(root, gpus=gpus) if args.action == "up" else Testbed.as_running(root)
    try:
        if args.action in _NODE_ACTIONS:
            return _NODE_ACTIONS[args.action](testbed, args.node)
        return _ACTIONS[args.action](testbed)
    except TestbedError as exc:
        print(f"elastic testbed {args.action}: {exc}", file=sys.stderr)
        return 1


def _run_command(args: argparse.Namespace) -> int:
    """`run --slurm R -- CMD`: CMD inside the release's root (on the host for the host's release)."""
    command = list(args.rest)  # _split_rest: what came after `--`
    if not command:
        raise UsageError("give the command to run after --, e.g. `elastic testbed run --slurm 26.05 -- sinfo`")
    if runs_natively(args.slurm):
        os.execvp(command[0], command)
    slurm_root = _mounted_root(args.slurm)
    env = dict(os.environ, SLURM_CONF=str(args.root / "etc" / "slurm.conf"))
    try:
        return slurm_root.run(command, env=env).returncode
    finally:
        _unmount_if_idle(slurm_root)


def _in_root(args: argparse.Namespace) -> int:
    """up/down/status/crash/revive of another release: the same command inside its root."""
    slurm_root = _mounted_root(args.slurm)
    argv = ["testbed", args.action, *([args.node] if args.node else []), "--root", str(args.root)]
    argv += ["--gpus", args.gpus] if args.gpus else []
    code = slurm_root.elastic(argv).returncode
    if args.action == "up" and code == 0:
        print(f"# Slurm {args.slurm} runs in {slurm_root.path}: run its commands with "
              f"`elastic testbed run --slurm {args.slurm} -- CMD` (e.g. `-- bash`)", file=sys.stderr)
    if args.action == "down":
        _unmount_if_idle(slurm_root)
    return code


def _mounted_root(release: str) -> SlurmRoot:
    if os.geteuid() != 0:
        raise UsageError(f"the Slurm {release} testbed runs in a root (chroot, mounts) and needs root")
    slurm_root = SlurmRoot(check_version(release))
    try:
        slurm_root.ensure_built()
        slurm_root.mount()
    except TestbedError as exc:
        raise UsageError(str(exc)) from None
    return slurm_root


def _unmount_if_idle(slurm_root: SlurmRoot) -> None:
    """Leave no mounts behind once nothing runs in the root (a testbed up keeps them)."""
    try:
        slurm_root.unmount()
    except TestbedError:
        pass


def _up(testbed: Testbed) -> int:
    conf = testbed.up()
    print(f"export SLURM_CONF={conf}")
    return 0


def _down(testbed: Testbed) -> int:
    testbed.down()
    return 0


def _status(testbed: Testbed) -> int:
    """Exit 0 when up, 1 when not, so scripts can test it. On the host it names the other releases' testbeds
    that run in their roots too."""
    if inside_root() is None:
        for release in SLURM_VERSIONS[1:]:
            if processes_in(root_path(release)):
                print(f"Slurm {release}: running in {root_path(release)} (`elastic testbed status --slurm {release}`)")
    if testbed.is_up():
        states = testbed.node_states()
        gpus = dict(zip(testbed.nodes, testbed.gpus))
        print(f"up: Slurm {inside_root() or _host_release(testbed.release)}, {len(states)} nodes ({', '.join(f'{n} {s} gpu:{gpus.get(n)}' for n, s in states.items())})")
        print(f"export SLURM_CONF={testbed.slurm_conf}")
        return 0
    running = [name for name, pid in testbed.daemon_pids().items() if pid is not None]
    detail = f"; still running: {', '.join(running)} (run `elastic testbed down`)" if running else ""
    print(f"down: Slurm {inside_root() or testbed.release} (root {testbed.root}){detail}")
    return 1


def _host_release(fallback: str) -> str:
    """The host's Slurm as its tools say it (22.05.8), else the release the testbed was written for."""
    try:
        done = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return fallback
    return done.stdout.split()[-1] if done.returncode == 0 and done.stdout.split() else fallback


def _crash(testbed: Testbed, node: str) -> int:
    killed = testbed.crash_node(node)
    print(f"{node} crashed: {len(killed)} process(es) killed; Slurm marks it NOT_RESPONDING, then DOWN, by its pings")
    return 0


def _revive(testbed: Testbed, node: str) -> int:
    testbed.revive_node(node)
    print(f"{node}: slurmd started again; Slurm takes it back into service when it registers")
    return 0


_ACTIONS = {"up": _up, "down": _down, "status": _status}
_NODE_ACTIONS = {"crash": _crash, "revive": _revive}
