"""Munge credentials through the `munge` and `unmunge` tools: the cluster's own proof of a caller's uid.

Why munge: munged already runs on every Slurm node with the cluster's key; a credential names the uid and gid
of the process that asked for it, is signed with that key, lives `ttl` seconds and is refused when decoded a
second time on the same host (munged's replay cache). The payload binds a credential to one request (the
method and a hash of its body), so a credential seen on the wire cannot carry another request either."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

DEFAULT_TTL_S = 60  # a request is sent at once; a credential older than this is refused
PAYLOAD_PREFIX = "elastic-api/1"


class CredentialError(Exception):
    """The credential is missing, malformed, expired, replayed or not for this request."""


class MungeUnavailable(CredentialError):
    """munge's tools or munged cannot be used here (not installed, munged not running)."""


@dataclass(frozen=True)
class Credential:
    uid: int
    gid: int
    payload: str


def request_payload(method: str, body: bytes) -> str:
    """What a request's credential carries: the method called and a hash of the exact body sent."""
    return f"{PAYLOAD_PREFIX} {method} {hashlib.sha256(body).hexdigest()}"


def _socket_args(socket: str | None) -> list[str]:
    socket = socket or os.environ.get("ELASTIC_MUNGE_SOCKET")
    return ["--socket", socket] if socket else []


def _tool(name: str) -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/bin/{name}", f"/usr/sbin/{name}") if os.path.exists(p)),
                                      None)
    if path is None:
        raise MungeUnavailable(f"`{name}` is not installed: install munge (Debian: apt-get install munge), the "
                               "same munged every Slurm node runs")
    return path


def mint(payload: str, *, ttl: int = DEFAULT_TTL_S, socket: str | None = None) -> str:
    """A credential for this process's uid carrying `payload`."""
    done = subprocess.run([_tool("munge"), "--string", payload, "--ttl", str(ttl), *_socket_args(socket)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise MungeUnavailable(f"munge could not make a credential: {done.stderr.strip() or done.returncode} "
                               "(is munged running? `systemctl status munge`)")
    return done.stdout.strip()


def verify(credential: str, *, socket: str | None = None) -> Credential:
    """The uid, gid and payload the credential proves; CredentialError (with munge's reason) otherwise."""
    if not credential or len(credential) > 16384 or not credential.startswith("MUNGE:"):
        raise CredentialError("no munge credential (expected `Authorization: MUNGE <credential>`)")
    done = subprocess.run([_tool("unmunge"), *_socket_args(socket)], input=credential, capture_output=True,
                          text=True, timeout=30)
    head, _, payload = done.stdout.partition("\n\n")
    meta = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in head.splitlines())}
    if done.returncode != 0:  # STATUS: Replayed credential (17), Expired credential (15), Invalid credential ...
        reason = re.sub(r"\s*\(\d+\)$", "", meta.get("STATUS", "")) or done.stderr.strip() or \
            f"unmunge exited {done.returncode}"
        raise CredentialError(f"munge credential refused: {reason}")
    try:
        return Credential(_number(meta["UID"]), _number(meta["GID"]), payload.rstrip("\n"))
    except (KeyError, ValueError):
        raise CredentialError(f"unmunge printed no uid/gid: {head[:200]!r}") from None


def _number(value: str) -> int:
    """1001 of unmunge's `alice (1001)`."""
    found = re.search(r"\((\d+)\)$", value)
    if found is None:
        raise ValueError(value)
    return int(found.group(1))
