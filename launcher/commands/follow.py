"""`--wait` for `elastic resize/preempt/suspend/resume`: follow a queued request to its answer.

What links a request to what it led to: the launcher takes one request at a time (Store.take_request
stamps taken_at), carries it out and only then answers it (complete_request); any migration of the job
that started after taken_at, before the answer, is that request's (launcher.loop.requests.handle_request
runs them in one go, nothing else of that launcher's runs in between). Nothing new is stored for it.

Progress goes to stderr (the request id stays alone on stdout for scripts); the exit status says how it
ended, EXIT below. The wait never cancels anything: a request still queued when it gives up stays queued.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Callable, TextIO

from db.liveness import lost_since

if TYPE_CHECKING:
    from db.records import AdminRequest, Job, Migration
    from db.store import Store

#: exit status of a --wait by how the request ended (2 stays a usage error: nothing was queued)
EXIT = {"done": 0, "failed": 1, "declined": 3, "refused": 4, "unanswered": 5, "timeout": 124}
DEFAULT_TIMEOUT_S = 600.0
POLL_S = 0.5
PAUSE_WAIT_S = 30.0  # after a migration succeeded, how long to wait for its pause (the new layout's first step)
ENDED = ("finished", "failed", "stopped")


def add_wait_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait", action="store_true",
                        help="follow the request to its answer, printing progress on stderr (taken by the "
                             "launcher, migration started, finished); exit 0 when it was carried out, 1 when "
                             "its migration failed, 3 when it was declined (training ended first), 4 when the "
                             "launcher refused it, 5 when the job ended or its launcher was lost before it "
                             "answered, 124 on --wait-timeout")
    parser.add_argument("--wait-timeout", type=float, metavar="SECONDS", default=None,
                        help=f"give up waiting after this long (implies --wait; default {DEFAULT_TIMEOUT_S:.0f}); "
                             "the request stays queued")


def wants_wait(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "wait", False) or getattr(args, "wait_timeout", None) is not None)


def _started(m: "Migration") -> str:
    return f"migration {m.id} started: {m.from_layout} -> {m.to_layout} ({m.trigger}, {m.kind})"


def _finished(m: "Migration") -> str:
    where = f" at step {m.at_step}" if m.at_step is not None else ""
    if m.status == "succeeded":
        return f"migration {m.id} succeeded{where}: now on {m.to_layout}"
    return f"migration {m.id} {m.status}{where}: {m.error or 'no reason recorded'}"


def _linked(store: "Store", req: "AdminRequest") -> list["Migration"]:
    """The job's migrations that started once `req` was taken (and before its answer), oldest first."""
    if req.taken_at is None:
        return []
    return [m for m in reversed(store.recent_migrations(req.job_id, limit=10))
            if m.started_at >= req.taken_at and (req.completed_at is None or m.started_at <= req.completed_at)]


def _ending(req: "AdminRequest", migrations: list["Migration"]) -> str:
    """done, failed, declined or refused: how an answered request ended."""
    if req.status == "done":
        return "done"
    if any(m.status == "declined" for m in migrations):
        return "declined"
    return "failed" if migrations else "refused"


def _unanswerable(job: "Job", req: "AdminRequest") -> str | None:
    """Why nobody will answer `req` (still pending), or None while someone may."""
    if (since := lost_since(job)) is not None:
        return f"job {job.name}'s launcher is lost (no heartbeat since {since:%Y-%m-%d %H:%M:%S} UTC)"
    if req.taken_at is None and (job.state in ENDED or (job.state == "suspended" and req.action != "resume")):
        return f"job {job.name} is {job.state}: no launcher will take request {req.id}"
    return None


def follow(store: "Store", rid: int, timeout_s: float | None = None, out: TextIO | None = None,
           sleep: Callable[[float], None] = time.sleep) -> int:
    """Print request `rid`'s progress until it is answered (or cannot be, or `timeout_s` passes); EXIT status."""
    out = out or sys.stderr
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + max(0.0, timeout_s)
    said: dict[object, str] = {}
    first_state: str | None = None  # the job's state when the wait began
    answered_at = 0.0

    def say(key: object, line: str) -> None:
        if said.get(key) != line:
            said[key] = line
            print(line, file=out, flush=True)

    while True:
        req = store.get_request(rid)
        job = store.get_job(req.job_id) if req else None
        if req is None or job is None:
            say("end", f"request {rid} is gone from the database")
            return EXIT["unanswered"]
        first_state = first_state or job.state
        if req.taken_at is not None:
            say("taken", f"request {rid} taken by the launcher ({req.taken_by})")
        migrations = _linked(store, req)
        for m in migrations:
            say((m.id, "start"), _started(m))
            if m.status not in ("running", "planned"):
                say((m.id, "end"), _finished(m))
            if m.pause_s is not None:
                say((m.id, "pause"), f"migration {m.id}: training paused {m.pause_s:.2f} s (last step committed "
                                     "on the old layout to the first on the new one)")
        if "state" in said or job.state != first_state:  # e.g. suspended; running again (a resume)
            say("state", f"job {job.name} is {job.state}")
        if req.status != "pending":
            how = _ending(req, migrations)
            answered_at = answered_at or time.monotonic()
            if (how == "done" and migrations and migrations[-1].status == "succeeded" and migrations[-1].pause_s is None
                    and job.state == "running" and time.monotonic() < min(deadline, answered_at + PAUSE_WAIT_S)):
                sleep(POLL_S)  # the pause is known once the new layout commits its first step (launcher.loop.pauses)
                continue
            say("end", f"request {rid} {how}: {req.message or 'no message'}")
            return EXIT[how]
        if (why := _unanswerable(job, req)) is not None:
            say("end", f"request {rid} unanswered: {why}; it stays queued")
            return EXIT["unanswered"]
        if time.monotonic() >= deadline:
            where = (f"migration {migrations[-1].id} is {migrations[-1].status}" if migrations else
                     "taken by the launcher, not answered yet" if req.taken_at else "not taken by a launcher yet")
            say("end", f"request {rid} timed out after {timeout_s:g} s ({where}); it stays queued: "
                       f"see `elastic jobs` and `elastic history --job {job.name}`")
            return EXIT["timeout"]
        sleep(POLL_S)
