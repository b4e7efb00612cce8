"""Who is at the other end of a TCP connection that comes from this host: the kernel's socket tables say.

Why: restart mode's rendezvous store serves the user's own script, which joins it with `env://` and
cannot send a credential. What can still be known is the owner of a connection from this machine: its
socket is in /proc/net/tcp (or tcp6) with the user id that opened it. So another user's process on the
batch node is refused; a connection from another node cannot be told apart (its socket is not here).
"""
from __future__ import annotations

import ipaddress
import os
import struct

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _plain(addr) -> str:
    """An address in one text form: IPv4-mapped IPv6 addresses (a dual-stack socket's view of IPv4) as IPv4."""
    addr = ipaddress.ip_address(addr)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr)


def _endpoint(field: str) -> tuple[str, int]:
    """An address:port as /proc/net/tcp{,6} writes it (hex, 32-bit words in host byte order)."""
    hex_addr, hex_port = field.split(":")
    raw = bytes.fromhex(hex_addr)
    words = b"".join(struct.pack("=I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
    return _plain(words), int(hex_port, 16)


def owner(peer: tuple, server: tuple, tables=_TABLES) -> int | None:
    """The user id of the socket at `peer` connected to `server` (both (host, port, ...)), or None when no
    socket of this host is that end (the connection comes from another machine)."""
    want = ((_plain(peer[0].split("%")[0]), peer[1]), (_plain(server[0].split("%")[0]), server[1]))
    for table in tables:
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and (_endpoint(fields[1]), _endpoint(fields[2])) == want:
                return int(fields[7])
    return None


def same_user(peer: tuple, server: tuple, tables=_TABLES) -> str | None:
    """None when the connection's process runs as this process's user, or comes from another machine;
    else why it is refused."""
    uid = owner(peer, server, tables)
    if uid is None or uid == os.getuid():
        return None
    return f"a process of user {uid} on this host (the job runs as {os.getuid()})"

