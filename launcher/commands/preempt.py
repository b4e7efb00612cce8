"""`elastic preempt JOB --nodes n3,n4 | --count N`: ask a job to give nodes back.

Like resize, this only queues an admin request for the launcher (plus an audit row), after the
shared validation (db.requests): never every node, never below the job's MIN, no duplicates.
"""
from __future__ import annotations

import argparse

from launcher.commands.follow import add_wait_arguments
from launcher.commands.history import add_db_argument
from launcher.commands.resize import request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id or name")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--nodes", metavar="LIST", help="comma-separated nodes to take away, e.g. n3,n4")
    which.add_argument("--count", type=int, metavar="N", help="take away any N nodes")
    add_db_argument(parser)
    add_wait_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from launcher.errors import UsageError

    if args.nodes is not None and not args.nodes.strip(", "):
        raise UsageError("--nodes is empty; give e.g. --nodes n3,n4")
    return request(args, "preempt", {"nodes": args.nodes} if args.nodes is not None else {"count": args.count})
