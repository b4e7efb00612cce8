"""ServiceStore: the store's methods, called on `elastic serve` over HTTP with this process's munge credential.

Why a stand-in for db.Store: the CLI and the launcher use the store the same way whether the history is a
local SQLite file (one user, one host) or the cluster's shared service; only `open_store` tells them apart by
the URL (http:// or https://). Users and sbatch scripts hold the service's address, never database credentials."""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from db.errors import NotFoundError
from service import munge
from service.codec import decode, encode
from service.errors import AccessDenied, NotAuthenticated, ServiceError

TIMEOUT_S = 60.0
RETRY_S = 30.0  # how long a call waits for a service that refuses connections (being restarted)


class _Refused(Exception):
    """The service refused the connection, or the call (429: too many calls from this address); nothing
    was done. `wait`: what the service asked to wait (Retry-After), if it said."""

    def __init__(self, wait: float | None = None) -> None:
        super().__init__()
        self.wait = wait


def is_service_url(url: str | None) -> bool:
    return bool(url) and url.split("://", 1)[0] in ("http", "https")


class ServiceStore:
    """Calls the service's /api/v1/<method>; answers and errors as db.Store gives them (NotFoundError,
    ValueError), plus AccessDenied and NotAuthenticated from the service's checks."""

    def __init__(self, url: str, *, timeout: float = TIMEOUT_S) -> None:
        self.url = self.display_url = url.rstrip("/")
        self.timeout = timeout

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One call; while the service refuses connections (restarting) or throttles this address it is tried
        again for up to RETRY_S, which is safe because nothing was done. A call that may have arrived is never
        repeated."""
        body = json.dumps({"args": encode(list(args)), "kwargs": encode(kwargs)}).encode()
        deadline, pause, said = time.monotonic() + RETRY_S, 0.5, False
        while True:
            try:
                return self._send(method, body)
            except _Refused as refused:
                remaining = deadline - time.monotonic()
                pause = refused.wait or pause
                if remaining <= 0:
                    raise ServiceError(
                        f"cannot reach the elastic service at {self.url}: it refused connections (or throttled "
                        f"them) for {RETRY_S:.0f} s (is `elastic serve` running there? check the URL in --db / "
                        "$ELASTIC_DB_URL)") from None
                if not said:  # say once why the command waits
                    said = True
                    print(f"the elastic service at {self.url} refuses connections or throttles them: trying "
                          f"again for up to {RETRY_S:.0f} s", file=sys.stderr, flush=True)
                time.sleep(min(pause, remaining))
                pause = min(pause * 2, 5.0)

    def _send(self, method: str, body: bytes) -> Any:
        credential = munge.mint(munge.request_payload(method, body))  # munged's socket: $ELASTIC_MUNGE_SOCKET
        req = urllib.request.Request(f"{self.url}/api/v1/{method}", data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"MUNGE {credential}"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return decode(json.load(resp)["result"])
        except urllib.error.HTTPError as exc:
            if exc.code == 429:  # throttled before anything was done (dashboard.throttle): wait as told
                raise _Refused(float(exc.headers.get("Retry-After") or 1)) from None
            raise self._refusal(method, exc) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ConnectionRefusedError):
                raise _Refused() from None
            raise ServiceError(f"cannot reach the elastic service at {self.url}: {reason} (is `elastic serve` "
                               "running there? check the URL in --db / $ELASTIC_DB_URL)") from None

    def _refusal(self, method: str, exc: urllib.error.HTTPError) -> Exception:
        try:
            answer = json.loads(exc.read() or b"{}")
        except ValueError:
            answer = {}
        message = answer.get("error") or f"HTTP {exc.code} from {self.url}"
        if exc.code == 401:
            return NotAuthenticated(f"the elastic service did not accept who you are: {message}")
        if exc.code == 403:
            return AccessDenied(f"refused by the elastic service: {message}")
        if exc.code == 404 and answer.get("kind") == "not_found":
            return NotFoundError(message)
        if exc.code == 400:
            return ValueError(message.split(": ", 1)[-1] if message.startswith("ValueError") else message)
        return ServiceError(f"the elastic service failed on {method}: {message}")

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)

    def take_requests(self, job_id: int, taker: str | None = None) -> Iterator[Any]:
        """As db.Store's: one request at a time, so a loop stopped early leaves the rest untaken."""
        while (req := self.call("take_request", job_id, taker)) is not None:
            yield req

    def close(self) -> None:
        pass

    def __enter__(self) -> "ServiceStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
