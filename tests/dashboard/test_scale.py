"""Issue 12 item 2: pages cost a constant number of queries, the jobs page pages and filters
(running first, finished on request), and the server is waitress with a pool sized to it."""
from __future__ import annotations

from typing import Any, Iterator

import pytest
from flask import Flask
from sqlalchemy import event

from db import Store
from tests.db.seed import layout_entries


class QueryCounter:
    def __init__(self, store: Store) -> None:
        self.n = 0
        self.engine = store._engine

    def __enter__(self) -> "QueryCounter":
        event.listen(self.engine, "before_cursor_execute", self._count)
        return self

    def __exit__(self, *_: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._count)

    def _count(self, *_: object) -> None:
        self.n += 1


def _queries(client: Any, store: Store, url: str) -> int:
    with QueryCounter(store) as qc:
        assert client.get(url).status_code == 200
    return qc.n


def _add_jobs(store: Store, n: int, state: str = "running", node_prefix: str = "x") -> list[int]:
    ids = []
    for i in range(n):
        jid = store.create_job(f"{state}-{i}", "pp1tp2dp1", 4, 2, state="running")
        store.record_rank_map(jid, 0, "pp1tp2dp1", layout_entries(1, 2, 1, [f"{node_prefix}{i}"], 4))
        store.start_migration(jid, "pp1tp2dp1", "pp1tp1dp1", "demo", {}, {})
        if state != "running":
            store.set_job_state(jid, state)
        ids.append(jid)
    return ids


@pytest.fixture
def counted(viewer: Any, store: Store) -> Iterator[Any]:
    viewer.get("/")  # warm the session and the pool
    yield viewer


def test_jobs_page_queries_do_not_grow_with_jobs(counted: Any, store: Store) -> None:
    few = _queries(counted, store, "/")
    _add_jobs(store, 70)
    _add_jobs(store, 5, "finished")
    assert _queries(counted, store, "/") == few
    assert _queries(counted, store, "/?page=2") == few


def test_job_page_queries_do_not_grow_with_other_jobs(counted: Any, store: Store) -> None:
    few = _queries(counted, store, "/jobs/1")
    _add_jobs(store, 40, node_prefix="n")  # some share node names with job 1
    assert _queries(counted, store, "/jobs/1") == few


def test_jobs_page_running_first_pages_and_filters(viewer: Any, store: Store) -> None:
    finished = _add_jobs(store, 3, "finished")
    running = _add_jobs(store, 60)
    first = viewer.get("/").text  # every state by default (a job that just finished is still listed), running first
    assert "65 jobs, running first" in first and "Page 1 of 2" in first and "page=2" in first
    assert first.count("data-job-id=") == 50 and f'data-job-id="{running[-1]}"' in first
    assert "finished-0" not in first and "finished-0" in viewer.get("/?page=2").text
    active = viewer.get("/?show=active").text
    assert "62 jobs (active)" in active and "finished-0" not in viewer.get("/?show=active&page=2").text
    every = viewer.get("/?show=all&page=2").text
    assert "65 jobs" in every and every.count("data-job-id=") == 15
    assert every.rindex("state-running") < every.index("state-finished")
    only = viewer.get("/?show=finished").text
    assert "3 jobs (finished)" in only and all(f'data-job-id="{j}"' in only for j in finished)
    assert 'hx-get="/?page=1&amp;show=finished"' in only  # polling keeps the page and the filter
    named = viewer.get("/?name=running-5").text
    assert named.count("data-job-id=") == 11  # running-5 and running-50..59
    assert viewer.get("/?show=bogus").status_code == 400 and viewer.get("/?page=0").status_code == 400
    assert viewer.get("/?name=" + "x" * 201).status_code == 400


def test_running_jobs_come_before_others_on_all(viewer: Any, store: Store) -> None:
    _add_jobs(store, 2, "failed")
    text = viewer.get("/?show=all").text
    states = [chunk.split('"')[0] for chunk in text.split('class="badge state-')[1:]]
    assert states == ["running", "running", "failed", "failed"]


def test_pool_is_sized_to_the_server_threads(db_url: str) -> None:
    from dashboard import create_app
    from tests.dashboard.conftest import SECRET

    app: Flask = create_app({"DB_URL": db_url, "SECRET_KEY": SECRET, "THREADS": 12})
    assert app.extensions["elastic_store"]._engine.pool.size() == 12


def test_elastic_dashboard_serves_with_waitress_by_default(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import waitress

    from launcher.cli import main
    from tests.dashboard.conftest import SECRET

    served: dict[str, Any] = {}
    monkeypatch.setattr(waitress, "serve", lambda app, **kw: served.update(kw, app=app))
    monkeypatch.setenv("ELASTIC_SECRET_KEY", SECRET)
    assert main(["dashboard", "--db", db_url, "--port", "8123", "--threads", "6"]) == 0
    assert (served["host"], served["port"], served["threads"]) == ("127.0.0.1", 8123, 6)
    assert served["app"].extensions["elastic_store"]._engine.pool.size() == 6
