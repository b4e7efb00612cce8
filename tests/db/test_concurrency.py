"""Many writers on one database at once lose and duplicate nothing: several processes (launchers,
CLI commands, dashboards on other hosts) queue, take and answer admin requests concurrently, queue
the same request at the same moment, and open an empty database together. On the real PostgreSQL
server and on a SQLite file on local disk."""
from __future__ import annotations

import multiprocessing
from collections import Counter
from typing import Any, Callable

from db import Store
from tests.db import writers
from tests.db.backends import both_backends
from tests.db.seed import layout_entries

WRITERS = 4
ROUNDS = 25


def _run(target: Callable[..., None], args_of: Callable[[int], tuple[Any, ...]], n: int = WRITERS) -> list[tuple[str, Any]]:
    """Start n spawned processes released together by a barrier; every message they sent."""
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(i), start, out)) for i in range(n)]
    for p in procs:
        p.start()
    messages, exited = [], 0
    while exited < n:
        kind, value = out.get(timeout=180)
        exited += kind == "exit"
        messages.append((kind, value))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return messages


def _jobs(url: str, n: int) -> list[int]:
    store = Store(url)
    ids = []
    for i in range(n):
        jid = store.create_job(f"job{i}", "pp1tp1dp2", 1, 4)
        store.record_rank_map(jid, 0, "pp1tp1dp2", layout_entries(1, 1, 2, [f"a{i}", f"b{i}"], 1))
        ids.append(jid)
    store.close()
    return ids


@both_backends
def test_writers_queueing_and_taking_at_once_lose_and_duplicate_nothing(fresh_url: str) -> None:
    jobs = _jobs(fresh_url, 3)
    messages = _run(writers.queue_and_take, lambda i: (fresh_url, i, jobs, ROUNDS))
    assert [v for k, v in messages if k == "error"] == []
    queued = [v for k, v in messages if k == "queued"]
    answered = [v for k, v in messages if k == "answered"]
    assert len(queued) == len(set(queued)) == WRITERS * ROUNDS
    assert sorted(answered) == sorted(queued), "a request was answered twice, or never"

    store = Store(fresh_url)
    rows = [r for j in jobs for r in store.list_requests(j, limit=1000)]
    assert sorted(r.id for r in rows) == sorted(queued)
    assert Counter(r.requested_by for r in rows) == Counter(f"w{i}-{k}" for i in range(WRITERS) for k in range(ROUNDS))
    assert {r.status for r in rows} == {"done"} and all(r.taken_by and r.taken_at for r in rows)
    assert all(r.message == f"answered by {r.taken_by}" for r in rows), "answered by a writer that did not take it"
    store.close()


@both_backends
def test_the_same_request_queued_at_the_same_moment_is_queued_once(fresh_url: str) -> None:
    jobs = _jobs(fresh_url, 1)
    for _ in range(3):  # a few rounds: each starts the writers together again
        messages = _run(writers.queue_identical, lambda i: (fresh_url, i, jobs[0]))
        assert [v for k, v in messages if k == "error"] == []
        queued = [v for k, v in messages if k == "queued"]
        refused = [v for k, v in messages if k == "refused"]
        assert len(queued) == 1 and len(refused) == WRITERS - 1, messages
        assert all("already pending" in r for r in refused)
        store = Store(fresh_url)
        (pending,) = store.pending_requests(jobs[0])
        assert pending.id == queued[0]
        assert store.complete_request(pending.id, "failed", "test: next round")
        store.close()


@both_backends
def test_writers_opening_an_empty_database_together_create_one_schema(fresh_url: str) -> None:
    from sqlalchemy import create_engine, text

    from db.schema import CURRENT_VERSION

    messages = _run(writers.open_store, lambda i: (fresh_url, i))
    assert [v for k, v in messages if k == "error"] == []
    assert [v for k, v in messages if k == "opened"] == [CURRENT_VERSION] * WRITERS
    engine = create_engine(fresh_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version FROM schema_version")).all() == [(CURRENT_VERSION,)]
    engine.dispose()
