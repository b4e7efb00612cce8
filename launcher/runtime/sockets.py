"""Cutting a failed world's connections, so that peers blocked on this process fail at once."""
from __future__ import annotations

import os
import socket


def cut_collective_sockets(keep_port: int) -> None:
    """Shut down this process's TCP connections except those to/of the control store.

    Neither destroying nor aborting a gloo process group closes its sockets, so a peer blocked in
    a receive from this process would wait out the collective timeout; after a shutdown() it
    sees "Connection closed by peer" at once. The process group is unusable afterwards, and is
    replaced by the next world this worker joins.
    """
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=int(fd))
        except (OSError, ValueError):
            continue
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            try:
                peer = s.getpeername()
            except OSError:
                continue
            if keep_port in (peer[1], s.getsockname()[1]):
                continue
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.detach()
