#!/usr/bin/env python3
"""Many writers on one database (issue 49): --writers processes at once, each queueing --rounds admin
requests over --jobs jobs and, after each, taking and answering whatever is pending, as launchers,
CLI commands and dashboards do on a shared database (tests/db/writers.py, the same code the tests run).

Counts what was queued, answered, answered twice or never, and the wall time. --postgres: a database on
a throwaway PostgreSQL server (tests/db/backends.py); default: a SQLite file in a temp dir (local disk).
Figures print as one JSON object; it exits 1 if anything was lost or duplicated.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(url: str, writers: int, rounds: int, jobs: int) -> dict[str, object]:
    from db import Store
    from tests.db import writers as w

    store = Store(url)
    ids = [store.create_job(f"job{i}", "pp1tp1dp1", 1, 1) for i in range(jobs)]
    store.close()
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(writers + 1), ctx.Queue()
    procs = [ctx.Process(target=w.queue_and_take, args=(url, i, ids, rounds, start, out)) for i in range(writers)]
    for p in procs:
        p.start()
    start.wait(120)  # every writer has opened the database: time the writing only
    t0 = time.perf_counter()
    messages, exited = [], 0
    while exited < writers:
        kind, value = out.get(timeout=600)
        exited += kind == "exit"
        messages.append((kind, value))
    seconds = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    queued = [v for k, v in messages if k == "queued"]
    answered = [v for k, v in messages if k == "answered"]
    store = Store(url)
    rows = [r for j in ids for r in store.list_requests(j, limit=10 ** 6)]
    store.close()
    return {"backend": url.split(":", 1)[0], "writers": writers, "rounds": rounds, "jobs": jobs,
            "queued": len(queued), "rows": len(rows), "answered": len(answered),
            "answered_twice": len(answered) - len(set(answered)), "never_answered": len(set(queued) - set(answered)),
            "not_done": sum(r.status != "done" for r in rows), "errors": [v for k, v in messages if k == "error"][:5],
            "seconds": round(seconds, 1), "requests_per_s": round(len(queued) / seconds, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--postgres", action="store_true")
    args = p.parse_args()
    if not (1 <= args.writers <= 64 and 1 <= args.rounds <= 10_000 and 1 <= args.jobs <= 100):
        p.error("bounds: writers 1..64, rounds 1..10000, jobs 1..100")
    pg = None
    try:
        if args.postgres:
            from tests.db.backends import PgServer, find_bindir

            bindir = find_bindir()
            if bindir is None:
                p.error("--postgres: no /usr/lib/postgresql/*/bin/initdb; run scripts/install-postgres.sh")
            pg = PgServer(bindir).start()
            url = pg.create_database()
        else:
            url = f"sqlite:///{tempfile.mkdtemp(prefix='elastic-writers-')}/w.db"
        figures = run(url, args.writers, args.rounds, args.jobs)
    finally:
        if pg is not None:
            pg.stop()
    print(json.dumps(figures))
    bad = figures["answered_twice"] or figures["never_answered"] or figures["not_done"] or figures["errors"] \
        or figures["rows"] != figures["queued"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
