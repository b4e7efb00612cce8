"""Throttling on Flask-Limiter: failed logins per user name and per address, CSRF-failure audit rows per
address, and the service's API per caller address.

Why failures and not requests for logins: a user who types the right password on the first try is never
slowed, while a guesser is stopped after a few tries -- by name (one account attacked from many places) and by
address (many names tried from one place). The counts live in the app's Limiter storage (moving windows of the
`limits` package, in memory: one process serves the dashboard), so one mechanism counts everything."""
from __future__ import annotations

import time

from flask import Flask
from flask_limiter import Limiter
from limits import RateLimitItemPerSecond

from dashboard.security import client_address

API_RATE = "3000 per minute"  # per caller address: launchers report a few times a second; a loop gets 429


class FailureCount:
    """At most `limit` failures per key in `window_s` seconds, counted in the Limiter's storage under `scope`."""

    def __init__(self, limiter: Limiter, scope: str, limit: int, window_s: int) -> None:
        self.limiter, self.scope, self.item = limiter, scope, RateLimitItemPerSecond(limit, window_s)

    def retry_after(self, key: str) -> int:
        """Whole seconds until `key` may fail again; 0 while it is under its limit."""
        stats = self.limiter.limiter.get_window_stats(self.item, self.scope, key)
        return 0 if stats.remaining > 0 else max(1, int(stats.reset_time - time.time()) + 1)

    def failed(self, key: str) -> bool:
        """Count one failure; False when `key` was already at its limit (nothing counted)."""
        return self.limiter.limiter.hit(self.item, self.scope, key)

    def forget(self, key: str) -> None:
        self.limiter.limiter.clear(self.item, self.scope, key)


def init_app(app: Flask, api_blueprint) -> None:
    """The app's Limiter (the API's request rate) and its failure counts (app.extensions["elastic_throttle"])."""
    limiter = Limiter(client_address, app=app, storage_uri="memory://", strategy="moving-window",
                      headers_enabled=True)
    limiter.limit(lambda: str(app.config.get("API_RATE_LIMIT") or API_RATE))(api_blueprint)
    window = int(app.config.get("LOGIN_WINDOW_S", 300))
    app.extensions["elastic_throttle"] = {
        "user": FailureCount(limiter, "login-user", int(app.config.get("LOGIN_USER_LIMIT", 5)), window),
        "address": FailureCount(limiter, "login-address", int(app.config.get("LOGIN_ADDRESS_LIMIT", 20)), window),
        # CSRF failures are audited, but at most this many rows per address per window (no log flood)
        "csrf_audit": FailureCount(limiter, "csrf-audit", int(app.config.get("CSRF_AUDIT_LIMIT", 20)), window),
    }
