"""`elastic resize JOB --nodes N`: queue a grow/shrink request for the launcher.

The command never touches Slurm or the job itself; it writes an admin request (and an
audit row) that the running launcher takes one at a time with Store.take_requests.
"""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from launcher.commands.follow import add_wait_arguments, follow, wants_wait
from launcher.commands.history import add_db_argument, open_store
from service.identity import local_user

if TYPE_CHECKING:
    from db.records import Job
    from db.store import Store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id or name")
    parser.add_argument("--nodes", required=True, type=int, metavar="N", help="target number of nodes")
    add_db_argument(parser)
    add_wait_arguments(parser)


def requester() -> str:
    """Who asks: this process's Unix user (what its uid names, never what a flag or $USER says). Through the
    shared service the request and audit rows name the user its munge credential proves instead."""
    return local_user()[0]


def lookup_job(store: "Store", ref: str) -> "Job":
    """The job named by id or name, or UsageError (exit 2) so nothing gets written."""
    from launcher.errors import UsageError

    job = store.find_job(ref)
    if job is None:
        raise UsageError(f"no job {ref!r} in {store.display_url}; see `elastic history` or the dashboard")
    return job


def request(args: argparse.Namespace, action: str, raw: dict[str, object]) -> int:
    """Validate (db.requests, the same rules as the dashboard and the launcher) and queue one request;
    action "resize" becomes grow or shrink by the nodes the job holds now."""
    from db.requests import held_nodes
    from launcher.errors import UsageError

    store = open_store(args.db)
    try:
        job = lookup_job(store, args.job)
        if action == "resize":
            action = "grow" if int(raw["nodes"]) > len(held_nodes(store, job.id)) else "shrink"  # type: ignore[call-overload]
        try:  # checked and queued in one transaction (concurrent CLIs and dashboards queue once)
            rid, params = store.queue_request(job.id, action, raw, requester())
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        rc = queue(store, job, action, params, requester(), rid)
        return follow(store, rid, args.wait_timeout) if wants_wait(args) else rc
    finally:
        store.close()


def queue(store: "Store", job: "Job", action: str, params: dict[str, object], who: str, rid: int) -> int:
    """Write the audit row of queued request `rid`; print the id on stdout, a summary on stderr."""
    store.audit(who, action, f"job:{job.id}", f"request {rid} queued via CLI: {params}")
    print(rid)
    print(f"request {rid} queued: {action} job {job.name} (id {job.id}) {params}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    from launcher.errors import UsageError

    if args.nodes < 1:
        raise UsageError("--nodes must be at least 1")
    return request(args, "resize", {"nodes": args.nodes})
