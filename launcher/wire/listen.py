"""A listening socket on the one address a store's clients are told, not on every interface.

Why: torch's TCPStore server listens on all of them (`*:PORT` in `ss -ltn`), so whoever reaches the
machine on any network could reach a job's keys. Bound to the one address the workers get (127.0.0.1 with
the local backend, the batch node's address on Slurm), a store server listens there alone.
"""
from __future__ import annotations

import socket


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` only (port 0: any free one), or one line saying what to give instead."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise RuntimeError(f"the control plane's address {host!r} does not resolve ({exc}); "
                           "give --master-addr an address of this host that the workers reach") from None
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(addr)
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise RuntimeError(f"cannot listen on {host}:{port} for the control plane ({exc.strerror}); give "
                           "--master-addr an address of this host (and --master-port a free port)") from None
    return listener

