"""Writer processes for tests/db/test_concurrency.py: each opens its own Store (its own connections,
as a launcher, a CLI command or a dashboard on another host would) and reports what it did on a queue.

Module-level functions, so multiprocessing's spawn start method can import them in a child.
"""
from __future__ import annotations

from typing import Any

from db import Store


def queue_and_take(url: str, me: int, jobs: list[int], rounds: int, start: Any, out: Any) -> None:
    """Queue `rounds` requests (round-robin over the jobs, each marked with who and which round),
    and after each, take and answer whatever is pending on every job, as a launcher does.
    Reports ("queued", id) and ("answered", id) for each; ("error", text) if anything raised."""
    try:
        store = Store(url, create=False, upgrade_schema=False)
        start.wait(60)
        for k in range(rounds):
            job = jobs[(me + k) % len(jobs)]
            out.put(("queued", store.add_request(job, "suspend", {"round": k}, f"w{me}-{k}")))
            for j in jobs:
                for req in store.take_requests(j, f"w{me}"):
                    if store.complete_request(req.id, "done", f"answered by w{me}"):
                        out.put(("answered", req.id))
                    else:
                        out.put(("error", f"request {req.id} taken by w{me} was already answered"))
        store.close()
    except Exception as exc:  # the parent asserts there are none
        out.put(("error", f"w{me}: {type(exc).__name__}: {exc}"))
    out.put(("exit", me))


def queue_identical(url: str, me: int, job: int, start: Any, out: Any) -> None:
    """Queue the same shrink as every other writer at the same moment (through queue_request, as the
    CLI and the dashboard do): ("queued", id) or ("refused", reason)."""
    try:
        store = Store(url, create=False, upgrade_schema=False)
        start.wait(60)
        try:
            rid, _params = store.queue_request(job, "shrink", {"nodes": "1"}, f"w{me}")
            out.put(("queued", rid))
        except ValueError as exc:
            out.put(("refused", str(exc)))
        store.close()
    except Exception as exc:
        out.put(("error", f"w{me}: {type(exc).__name__}: {exc}"))
    out.put(("exit", me))


def open_store(url: str, me: int, start: Any, out: Any) -> None:
    """Open (creating the schema if nobody has yet) at the same moment as the others."""
    try:
        start.wait(60)
        store = Store(url)
        out.put(("opened", store.schema_version))
        store.close()
    except Exception as exc:
        out.put(("error", f"w{me}: {type(exc).__name__}: {exc}"))
    out.put(("exit", me))
