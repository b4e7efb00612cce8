"""HTTP hardening shared by every page: response headers, strict integer URL parts, the
client address for audit rows (throttling: dashboard.throttle).

Kept apart from auth.py so each piece stays small; `init_app` wires all of it.
"""
from __future__ import annotations

import threading
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


def _headers(resp: Response) -> Response:
    for name, value in HEADERS.items():
        resp.headers.setdefault(name, value)
    return resp


def init_app(app: Flask) -> None:
    """Install the id converter (before any blueprint routes), headers and the hashing slots."""
    app.url_map.converters["int"] = DbIdConverter
    app.after_request(_headers)
    # Password hashing (scrypt) takes ~32 MiB each: a few at a time keep memory flat under a flood.
    app.extensions["elastic_hash_slots"] = threading.BoundedSemaphore(int(app.config.get("HASH_SLOTS", 2)))
