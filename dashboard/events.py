"""Live updates as server-sent events: GET /events streams `placement`, `migration` and `request`
events; static/live.js turns them into an `elastic-refresh` of the panels on the page (the 5 s
polling stays as the fallback when no stream is open).

Built for a threaded WSGI server (waitress, a fixed pool of threads):
  * one `ChangeFeed` per app polls `Store.change_marks()` (a few tiny queries, one short
    transaction, the connection back in the pool at once) every FEED_SECONDS, only while
    someone listens, and fans what changed out to every open stream; a stream itself never
    touches the database, so it holds no connection between events;
  * a stream occupies a server thread, so at most SSE_MAX_STREAMS are open at once (default:
    half of THREADS); one more gets 204, which tells EventSource to stop and leaves polling on;
  * each stream ends after SSE_MAX_SECONDS (default 120) with a `retry` hint, so threads free
    up and the browser reconnects, and sends a comment every SSE_PING_SECONDS to notice gone clients.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

from flask import Blueprint, Flask, Response, current_app, stream_with_context

from dashboard.deps import owner_shown, store

if TYPE_CHECKING:
    from db.store import Store

bp = Blueprint("events", __name__)


class ChangeFeed:
    """Polls the database for changes while streams listen; hands each stream the events."""

    def __init__(self, store: "Store", every_s: float = 0.5, max_streams: int = 4) -> None:
        self.store, self.every_s, self.max_streams = store, every_s, max_streams
        self._subs: set[queue.Queue[tuple[str, dict[str, Any]]]] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._marks: dict[str, tuple[Any, ...]] | None = None
        self._seen: dict[str, dict[int, str]] = {"migration": {}, "request": {}}

    def subscribe(self) -> queue.Queue[tuple[str, dict[str, Any]]] | None:
        """A queue of (event, data) for one stream, or None when the stream limit is reached."""
        with self._lock:
            if len(self._subs) >= self.max_streams:
                return None
            q: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue(maxsize=100)
            self._subs.add(q)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="elastic-change-feed", daemon=True)
                self._thread.start()
            return q

    def unsubscribe(self, q: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
        with self._lock:
            self._subs.discard(q)

    @property
    def listeners(self) -> int:
        with self._lock:
            return len(self._subs)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._subs:
                    self._thread = None
                    return
            try:
                for event in self.poll():
                    self._publish(*event)
            except Exception as exc:  # a database hiccup must not kill the feed; streams see why
                self._publish("error", {"message": f"{type(exc).__name__}: {exc}"[:300]})
            time.sleep(self.every_s)

    def _publish(self, name: str, data: dict[str, Any]) -> None:
        with self._lock:
            subs = list(self._subs)
        for q in subs:
            try:
                q.put_nowait((name, data))
            except queue.Full:  # a stream that does not read: it will catch up with a refresh
                pass

    def poll(self) -> list[tuple[str, dict[str, Any]]]:
        """The events since the previous poll (none on the first: that is the baseline)."""
        marks = self.store.change_marks()
        first, changed = self._marks is None, [k for k in marks if self._marks and marks[k] != self._marks[k]]
        self._marks = marks
        events: list[tuple[str, dict[str, Any]]] = []
        if "migration" in changed or first:
            for m in self.store.history(limit=5):
                events += self._if_new("migration", m["id"], m["status"], {
                    "id": m["id"], "job_id": m["job_id"], "job": m["job_name"], "status": m["status"],
                    "from": m["from_layout"], "to": m["to_layout"], "pause_s": m.get("pause_s"),
                    "phases": {k[:-2]: v for k, v in m.items() if k.endswith("_s") and k not in
                               ("duration_s", "pause_s") and v is not None}})
        if "request" in changed or first:
            for r in self.store.list_requests(limit=5):
                events += self._if_new("request", r.id, r.status, {
                    "id": r.id, "job_id": r.job_id, "action": r.action, "status": r.status,
                    "message": r.message or ""})
        if "placement" in changed:
            events.append(("placement", {"marks": list(marks["placement"])}))
        return [] if first else events

    def _if_new(self, kind: str, key: int, status: str, data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        seen = self._seen[kind]
        if seen.get(key) == status:
            return []
        seen[key] = status
        if len(seen) > 200:
            for old in sorted(seen)[:100]:
                del seen[old]
        return [(kind, data)]


def sse(name: str, data: dict[str, Any]) -> str:
    """One event in text/event-stream framing."""
    return f"event: {name}\ndata: {json.dumps(data, default=str)}\n\n"


def feed() -> ChangeFeed:
    return current_app.extensions["elastic_feed"]


@bp.get("/events")
def events() -> Response:
    q = feed().subscribe()
    if q is None:  # every stream slot taken: 204 makes EventSource give up, the page keeps polling
        return Response(status=204)
    cfg = current_app.config
    max_s, ping_s = float(cfg.get("SSE_MAX_SECONDS", 120)), float(cfg.get("SSE_PING_SECONDS", 15))
    f, owner = feed(), owner_shown()

    def hidden(data: dict[str, Any]) -> bool:
        """Another user's job's event, where the site keeps jobs private from this user."""
        if owner is None or "job_id" not in data:
            return False
        job = store().get_job(data["job_id"])
        return job is None or job.owner != owner

    def stream() -> Iterator[str]:
        try:
            yield "retry: 1000\n: connected\n\n"
            end = time.monotonic() + max_s
            while (left := end - time.monotonic()) > 0:
                try:
                    name, data = q.get(timeout=min(ping_s, left))
                except queue.Empty:
                    yield ": ping\n\n"
                    continue
                if not hidden(data):
                    yield sse(name, data)
        finally:
            f.unsubscribe(q)

    resp = Response(stream_with_context(stream()), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    resp.call_on_close(lambda: f.unsubscribe(q))  # also when the client left before the first event
    return resp


def init_app(app: Flask) -> None:
    threads = int(app.config.get("THREADS") or 8)
    app.extensions["elastic_feed"] = ChangeFeed(
        app.extensions["elastic_store"], float(app.config.get("SSE_FEED_SECONDS", 0.5)),
        int(app.config.get("SSE_MAX_STREAMS") or max(1, threads // 2)))
    app.register_blueprint(bp)
