"""`elastic suspend JOB`: ask a running job to write its state once and give every device back.

Like resize, this only queues an admin request (plus an audit row); the launcher carries it out at
the next step boundary and records the job as suspended with its checkpoint (see elastic-launch).
"""
from __future__ import annotations

import argparse

from launcher.commands.history import add_db_argument, open_store
from launcher.commands.resize import queue, requester


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id or name")
    add_db_argument(parser)
    parser.add_argument("--user", help="who asks (default $USER)")


def request(args: argparse.Namespace, action: str, wanted: str) -> int:
    from launcher.cli import UsageError

    store = open_store(args.db)
    try:
        job = store.find_job(args.job)
        if job is None:
            raise UsageError(f"no job {args.job!r} in {store.display_url}; see `elastic history` or the dashboard")
        if job.state != wanted:
            raise UsageError(f"job {job.name} (id {job.id}) is {job.state}; {action} needs a {wanted} job")
        return queue(store, job, action, {}, requester(args.user))
    finally:
        store.close()


def run(args: argparse.Namespace) -> int:
    return request(args, "suspend", "running")
