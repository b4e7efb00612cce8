"""Server-sent events: the change feed on a database, the stream limit, and a real migration (the
launcher with real worker processes on the local backend) seen live through /events served by
waitress, the dashboard's threaded server."""
from __future__ import annotations

import http.cookiejar
import json
import re
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from dashboard import create_app
from dashboard.events import ChangeFeed
from db import Store
from tests.dashboard.conftest import PASSWORDS, SECRET, login
from tests.db.seed import FakeClock, layout_entries


def test_feed_reports_what_changed_once(tmp_path: Path) -> None:
    clock = FakeClock()
    store = Store(f"sqlite:///{tmp_path / 'f.db'}", clock=clock)
    job = store.create_job("j", "pp1tp2dp1", 2, 4, nodes=["n1"])
    feed = ChangeFeed(store)
    assert feed.poll() == []  # the first poll is the baseline
    assert feed.poll() == []
    store.record_rank_map(job, 0, "pp1tp2dp1", layout_entries(1, 2, 1, ["n1"], 2))
    assert [name for name, _ in feed.poll()] == ["placement"]
    rid = store.add_request(job, "shrink", {"nodes": 1}, "ops")
    ((name, data),) = feed.poll()
    assert name == "request" and (data["id"], data["status"]) == (rid, "pending")
    mid = store.start_migration(job, "pp1tp2dp1", "pp1tp1dp1", "resize", {}, {})
    ((name, data),) = feed.poll()
    assert name == "migration" and (data["id"], data["status"], data["phases"]) == (mid, "running", {})
    store.finish_migration(mid, "succeeded", 1, 2, True, {"plan": 0.25, "execute": 0.5})
    store.complete_request(rid, "done", "shrunk")
    got = dict(feed.poll())
    assert got["migration"]["status"] == "succeeded" and got["migration"]["phases"] == {"plan": 0.25, "execute": 0.5}
    assert (got["request"]["status"], got["request"]["message"]) == ("done", "shrunk")
    assert feed.poll() == []
    store.close()


def test_stream_limit_answers_204_and_frees_the_slot(db_url: str) -> None:
    app = create_app({"DB_URL": db_url, "SECRET_KEY": SECRET, "SSE_MAX_STREAMS": 1, "SSE_MAX_SECONDS": 0.2})
    client = app.test_client()
    login(client, "viewer")
    first = client.get("/events", buffered=False)
    assert first.status_code == 200 and first.mimetype == "text/event-stream"
    assert client.get("/events").status_code == 204  # the one slot is taken: the page keeps polling
    text = b"".join(first.response).decode()  # ends by itself after SSE_MAX_SECONDS
    first.close()
    assert text.startswith("retry: 1000\n") and ": connected" in text
    assert app.extensions["elastic_feed"].listeners == 0
    anon = app.test_client()
    assert anon.get("/events").status_code in (302, 401)  # logged-in users only


class _Session:
    """A logged-in HTTP client on a real server (cookies kept), for the stream."""

    def __init__(self, base: str, role: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        page = self.opener.open(f"{base}/login", timeout=10).read().decode()
        token = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
        form = urllib.parse.urlencode({"username": role, "password": PASSWORDS[role], "csrf_token": token}).encode()
        self.opener.open(f"{base}/login", data=form, timeout=10).read()

    def events(self, into: list[tuple[float, str, dict[str, Any]]], stop: threading.Event) -> None:
        with self.opener.open(f"{self.base}/events", timeout=30) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            name = None
            while not stop.is_set():
                line = resp.readline().decode()
                if not line:
                    return
                if line.startswith("event: "):
                    name = line[7:].strip()
                elif line.startswith("data: ") and name:
                    into.append((time.monotonic(), name, json.loads(line[6:])))


def test_a_real_migration_is_seen_live_through_waitress(tmp_path: Path) -> None:
    from waitress.server import create_server

    from tests.launcher.test_launch_local import run_job

    url = f"sqlite:///{tmp_path}/e.db"
    store = Store(url)
    for role in PASSWORDS:
        store.add_user(role, PASSWORDS[role], role)
    app = create_app({"DB_URL": url, "SECRET_KEY": SECRET, "SSE_FEED_SECONDS": 0.1, "SSE_MAX_SECONDS": 300,
                      "THREADS": 4})
    server = create_server(app, host="127.0.0.1", port=0, threads=4)
    threading.Thread(target=server.run, daemon=True).start()
    base = f"http://127.0.0.1:{server.effective_port}"
    seen: list[tuple[float, str, dict[str, Any]]] = []
    stop = threading.Event()
    reader = threading.Thread(target=_Session(base, "viewer").events, args=(seen, stop), daemon=True)
    reader.start()
    try:
        def preempt(la, _url):
            la.db.add_request(la.job_id, "preempt", {"nodes": ["node1"]}, "tester")

        rc, la, _s, _u = run_job(tmp_path, [(3, preempt)])
        assert rc == 0, [o.message for o in la.outcomes]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(n == "request" and d["status"] == "done" for _, n, d in seen):
            time.sleep(0.1)
    finally:
        stop.set()
        server.close()
    names = [n for _, n, _ in seen]
    assert "placement" in names
    migs = [d for _, n, d in seen if n == "migration"]
    statuses = [d["status"] for d in migs]
    assert "running" in statuses and statuses[-1] == "succeeded", statuses  # seen while it ran, then done
    assert migs[-1]["from"] == "pp2tp2dp1" and migs[-1]["to"] == "pp2tp1dp1"
    assert {"plan", "execute", "rebuild"} <= set(migs[-1]["phases"])
    reqs = [d["status"] for _, n, d in seen if n == "request"]
    assert reqs[0] == "pending" and reqs[-1] == "done"
    store.close()
