"""HTTP hardening shared by every page: response headers, strict integer URL parts, the
client address for audit rows, and failure windows (login throttling).

Kept apart from auth.py so each piece stays small; `init_app` wires all of it.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Any

from flask import Flask, Response, request
from werkzeug.routing import BaseConverter, ValidationError

from db.vocab import MAX_ADDRESS, MAX_ID

# htmx runs from a static file and never evaluates strings (allowEval is off in base.html), so
# scripts need no 'unsafe-*'; inline style attributes (placement colours) need 'unsafe-inline'.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


class DbIdConverter(BaseConverter):
    """`<int:...>` for database ids: ASCII digits only (werkzeug's takes `١`) and at most 2**63-1
    (larger ones overflow SQLite), so such URLs are a plain 404."""

    regex = r"[0-9]{1,19}"
    weight = 50

    def to_python(self, value: str) -> int:
        number = int(value)
        if not 0 < number <= MAX_ID:
            raise ValidationError()
        return number

    def to_url(self, value: Any) -> str:
        return str(int(value))


def client_address() -> str:
    """Who sent the request, for audit rows (the proxy's address when behind one)."""
    return (request.remote_addr or "?")[:MAX_ADDRESS]


class FailureWindow:
    """Failures per key (a user name, a client address) in a sliding window of `window_s` seconds.

    Once a key has `limit` failures in the window, `retry_after(key)` says how long to wait; login
    refuses such attempts before any password is hashed (HTTP 429). Memory is bounded: at most
    `max_keys` keys are tracked, the least recently failed forgotten first.
    """

    def __init__(self, limit: int, window_s: float = 300.0, max_keys: int = 10_000,
                 clock: Any = time.monotonic) -> None:
        self.limit, self.window_s, self.max_keys, self.clock = limit, window_s, max_keys, clock
        self._fails: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def _recent(self, key: str, now: float) -> deque[float]:
        q = self._fails.get(key) or deque()
        while q and q[0] <= now - self.window_s:
            q.popleft()
        return q

    def retry_after(self, key: str) -> int:
        """Whole seconds until `key` may fail again; 0 when it is under its limit now."""
        now = self.clock()
        with self._lock:
            q = self._recent(key, now)
            if len(q) < self.limit:
                return 0
            return int(q[len(q) - self.limit] + self.window_s - now) + 1

    def failed(self, key: str) -> None:
        now = self.clock()
        with self._lock:
            q = self._recent(key, now)
            q.append(now)
            self._fails[key] = q
            self._fails.move_to_end(key)
            while len(self._fails) > self.max_keys:
                self._fails.popitem(last=False)

    def forget(self, key: str) -> None:
        with self._lock:
            self._fails.pop(key, None)


def _headers(resp: Response) -> Response:
    for name, value in HEADERS.items():
        resp.headers.setdefault(name, value)
    return resp


def init_app(app: Flask) -> None:
    """Install the id converter (before any blueprint routes), headers and the throttle."""
    app.url_map.converters["int"] = DbIdConverter
    app.after_request(_headers)
    window = float(app.config.get("LOGIN_WINDOW_S", 300))
    app.extensions["elastic_throttle"] = {
        "user": FailureWindow(int(app.config.get("LOGIN_USER_LIMIT", 5)), window),
        "address": FailureWindow(int(app.config.get("LOGIN_ADDRESS_LIMIT", 20)), window),
        # CSRF failures are audited, but at most this many rows per address per window (no log flood)
        "csrf_audit": FailureWindow(int(app.config.get("CSRF_AUDIT_LIMIT", 20)), window),
    }
    # Password hashing (scrypt) takes ~32 MiB each: a few at a time keep memory flat under a flood.
    app.extensions["elastic_hash_slots"] = threading.BoundedSemaphore(int(app.config.get("HASH_SLOTS", 2)))
