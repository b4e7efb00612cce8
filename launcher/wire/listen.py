"""A store server that listens only on the address its clients are told, not on every interface.

Why: torch's TCPStore server listens on all of them (`*:PORT` in `ss -ltn`), so whoever reaches the
machine on any network could read and write a job's keys: post events, settle steps "no", mark worlds
aborted. Handed a socket bound to the one address the workers get (127.0.0.1 with the local backend, the
batch node's address on Slurm), it listens there alone, and the store closes that socket when it goes.
"""
from __future__ import annotations

import socket
from datetime import timedelta


def serve_store(host: str, port: int, timeout_s: float):
    """A TCPStore server listening on `host`:`port` only (port 0: any free one; `store.port` says which)."""
    import torch.distributed as dist

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
    store = dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.fileno())
    listener.detach()  # the store owns the socket now and closes it when it goes
    return store
