"""`elastic testbed up|down|status [--root DIR] [--gpus 4,4,2,2]`, `elastic testbed crash|revive NODE`: the
local Slurm cluster, and a node crash on it (for trying what a job survives).

The default shape is 4 nodes x 4 GPUs. `up --gpus 4,4,2,2` brings up nodes of different GPU counts
with a partition per count (gpu4, gpu2) besides `debug`; a later plain `up` brings the default back.
`status` and `down` act on whatever shape is running.

`up` ends with an `export SLURM_CONF=...` line so `eval "$(elastic testbed up)"`
points the shell's Slurm commands at the testbed; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from launcher.errors import UsageError
from launcher.testbed.cluster import Testbed
from launcher.testbed.config import DEFAULT_GPUS, DEFAULT_ROOT, parse_gpus
from launcher.testbed.errors import TestbedError

ACTIONS = ("up", "down", "status", "crash", "revive")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=ACTIONS,
                        help="bring the cluster up, down, or report its state; `crash NODE` kills a node's slurmd, "
                             "step daemons and tasks as a crash would, `revive NODE` starts its slurmd again")
    parser.add_argument("node", nargs="?", metavar="NODE", help="crash/revive only: the node, e.g. n2")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                        help=f"folder holding all testbed state (default {DEFAULT_ROOT})")
    parser.add_argument("--gpus", default=None, metavar="G,G,...",
                        help="up only: GPUs of each node, e.g. 4,4,2,2 (default "
                             f"{','.join(map(str, DEFAULT_GPUS))}); uneven counts add partitions gpu4, gpu2, ...")


def run(args: argparse.Namespace) -> int:
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


def _up(testbed: Testbed) -> int:
    conf = testbed.up()
    print(f"export SLURM_CONF={conf}")
    return 0


def _down(testbed: Testbed) -> int:
    testbed.down()
    return 0


def _status(testbed: Testbed) -> int:
    """Exit 0 when up, 1 when not, so scripts can test it."""
    if testbed.is_up():
        states = testbed.node_states()
        gpus = dict(zip(testbed.nodes, testbed.gpus))
        print(f"up: {len(states)} nodes ({', '.join(f'{n} {s} gpu:{gpus.get(n)}' for n, s in states.items())})")
        print(f"export SLURM_CONF={testbed.slurm_conf}")
        return 0
    running = [name for name, pid in testbed.daemon_pids().items() if pid is not None]
    detail = f"; still running: {', '.join(running)} (run `elastic testbed down`)" if running else ""
    print(f"down (root {testbed.root}){detail}")
    return 1


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
