"""`elastic preempt JOB --nodes n3,n4 | --count N`: ask a job to give nodes back.

Like resize, this only queues an admin request for the launcher (plus an audit row).
"""
from __future__ import annotations

import argparse

from launcher.commands.history import add_db_argument, open_store
from launcher.commands.resize import lookup_job, nodes_held, queue, requester


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id or name")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--nodes", metavar="LIST", help="comma-separated nodes to take away, e.g. n3,n4")
    which.add_argument("--count", type=int, metavar="N", help="take away any N nodes")
    add_db_argument(parser)
    parser.add_argument("--user", help="who asks (default $USER)")


def run(args: argparse.Namespace) -> int:
    from launcher.cli import UsageError

    store = open_store(args.db)
    try:
        job = lookup_job(store, args.job)
        held = nodes_held(store, job.id)
        if args.nodes is not None:
            wanted = list(dict.fromkeys(n.strip() for n in args.nodes.split(",") if n.strip()))
            if not wanted:
                raise UsageError("--nodes is empty; give e.g. --nodes n3,n4")
            unknown = [n for n in wanted if n not in held]
            if unknown:
                raise UsageError(f"job {job.name} does not hold {', '.join(unknown)}; it holds "
                                 f"{', '.join(held) or 'no nodes'}")
            params: dict[str, object] = {"nodes": wanted}
        else:
            if not 1 <= args.count <= len(held):
                raise UsageError(f"--count must be 1..{len(held)} (nodes job {job.name} holds)")
            params = {"count": args.count}
        if job.pinned_node and job.pinned_node in params.get("nodes", []):  # type: ignore[operator]
            raise UsageError(f"{job.pinned_node} is the job's pinned node and cannot be preempted")
        return queue(store, job, "preempt", params, requester(args.user))
    finally:
        store.close()
