"""Restart mode's rendezvous admits the job user's processes on this host and refuses other users' ones."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from launcher.loop.restart import ScriptRendezvous
from launcher.wire.local_peer import owner, same_user

_AS_ROOT = pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a process as another user")


def test_a_local_connection_s_owner_is_read_from_the_kernel_over_ipv4_and_ipv6_sockets():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::ffff:127.0.0.1")):
            with socket.socket(family, socket.SOCK_STREAM) as client:
                client.connect((host, port))
                accepted, peer = server.accept()
                with accepted:
                    assert owner(peer, accepted.getsockname()) == os.getuid()
                    assert same_user(peer, accepted.getsockname()) is None
    assert owner(("192.0.2.7", 40000), ("127.0.0.1", port)) is None  # not a socket of this host: not refused


def _as_nobody_send(port: int, payload: bytes) -> subprocess.CompletedProcess:
    """A process of user nobody connects and sends `payload` (bash's /dev/tcp: no Python of root's needed)."""
    escaped = "".join(f"\\x{b:02x}" for b in payload)
    script = f"exec 3<>/dev/tcp/127.0.0.1/{port}; printf '{escaped}' >&3; sleep 0.5; exec 3>&-"
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "bash", "-c", script],
                          capture_output=True, text=True, timeout=30)


@_AS_ROOT
def test_the_script_rendezvous_refuses_another_user_s_process_and_serves_the_job_s():
    said = []
    rdzv = ScriptRendezvous("127.0.0.1", said.append)
    port = rdzv.new_world(1)
    key = b"/abort"
    set_request = bytes([0]) + (0x3C85F7CE).to_bytes(4, "little") + bytes([1]) + len(key).to_bytes(8, "little") \
        + key + (1).to_bytes(8, "little") + b"1"
    assert _as_nobody_send(port, set_request).returncode in (0, 1)  # bash may see the closed socket
    deadline = time.monotonic() + 5
    while not said and time.monotonic() < deadline:
        time.sleep(0.01)
    assert said and "a process of user 65534 on this host" in said[0]
    assert rdzv.store.key_count() == 0 and not rdzv.formed()
    # the job's script (this process's user) gets in, env:// style: no prefix, any key
    script = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    script.set("rank0", "addr")
    assert script.get("rank0") == b"addr" and rdzv.formed() and script.num_keys() == 1
    assert rdzv.new_world(1) != port  # a restart: a fresh store; the old one is closed
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    rdzv.close()
