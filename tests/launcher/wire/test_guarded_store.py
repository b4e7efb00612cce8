"""The control plane's store answers the job's clients as torch's own server does, and nobody else."""
from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from launcher.wire.control import Control
from launcher.wire.guarded_store import MAGIC, GuardedStoreServer, RefusalLog


def _client(port: int, secret: str | None, timeout_s: float = 5.0):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(secret, store) if secret else store


def _script(store) -> list:
    """Every request the control plane and torch's process groups send, and what each answers."""
    out = []
    store.set("a", "1")
    out += [store.get("a"), store.add("n", 3), store.add("n", -1), store.get("n"), store.check(["a", "n"]),
            store.check(["a", "zz"])]
    out += [store.compare_set("cs", "", "x"), store.compare_set("cs", "y", "z"), store.compare_set("cs", "x", "w"),
            store.compare_set("missing", "q", "r"), store.check(["missing"]), store.get("cs")]
    store.multi_set(["m1", "m2"], ["v1", b"\x00\xff"])
    out += [store.multi_get(["m1", "m2", "a"]), store.delete_key("m1"), store.delete_key("m1"), store.check(["m1"])]
    store.append("ap", "x")
    store.append("ap", "y")
    out.append(store.get("ap"))
    store.set("big", b"\x01" * 3_000_000)
    out.append(len(store.get("big")))
    return out


def test_the_job_s_client_gets_what_torch_s_own_server_answers():
    """Oracle: the same requests against torch's TCPStore server (an independent implementation)."""
    theirs = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    server = GuardedStoreServer("127.0.0.1", 0, "s3cret")
    assert _script(_client(server.port, "s3cret")) == _script(dist.PrefixStore("s3cret", theirs))


def test_waits_end_when_their_keys_come_and_time_out_when_they_do_not():
    server = GuardedStoreServer("127.0.0.1", 0, "k")
    waiter, setter = _client(server.port, "k"), _client(server.port, "k")
    threading.Timer(0.2, lambda: (setter.set("w1", "1"), setter.add("w2", 1))).start()
    t0 = time.monotonic()
    waiter.wait(["w1", "w2"])
    assert 0.15 < time.monotonic() - t0 < 3
    threading.Timer(0.2, lambda: setter.set("late", "L")).start()
    assert waiter.get("late") == b"L"  # a get waits for its key
    with pytest.raises(dist.DistStoreError):
        waiter.wait(["never"], timedelta(seconds=0.3))
    waiter.set("after", "1")  # the cancelled wait left the connection usable
    assert waiter.get("after") == b"1"


def test_a_process_group_forms_on_it(tmp_path):
    """gloo's rendezvous (and barrier) through the job's client: what every training world does."""
    import torch

    server = Control("127.0.0.1", 0, server=True)
    group = dist.ProcessGroupGloo(server.world_store("t"), 0, 1, timedelta(seconds=30))
    x = torch.ones(3)
    group.allreduce([x]).wait()
    assert x.tolist() == [1.0, 1.0, 1.0]


def _raw(port: int, request: bytes) -> bytes:
    """What the server sends back to `request` before it closes the connection (or 2 s pass)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(struct.pack("<BI", 0, MAGIC) + request)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except socket.timeout:
            return got + b"<still open>"
        return got


def test_a_stranger_reads_writes_and_lists_nothing_and_is_told_to_the_launcher():
    """Issue 46: a plain TCPStore client wrote abort/w0 to a running job and the job stopped training."""
    said = []
    job = Control("127.0.0.1", 0, server=True, on_refused=said.append)
    job.set_json("ev/0", {"kind": "start"})
    stranger = _client(job.port, None, timeout_s=2)
    stranger.set("abort/w0", "1")  # torch's client does not wait for an answer to a set: the server drops it
    with pytest.raises(dist.DistNetworkError):
        stranger.get("ev/0")
    guesser = _client(job.port, "0123456789abcdef0123456789abcdef", timeout_s=2)
    with pytest.raises(dist.DistNetworkError):
        guesser.check(["ev/0"])
    key = b"/ev/0"
    for request in (bytes([17]), bytes([7]), bytes([3]) + struct.pack("<Q", len(key)) + key):
        assert _raw(job.port, request) == b""  # list the keys, count them, get a key: closed, nothing said
    assert not job.has("abort/w0") and job.get_json("ev/0") == {"kind": "start"}
    deadline = time.monotonic() + 5
    while len(said) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert said and "refused a connection from 127.0.0.1:" in said[0] and "'/abort/w0' outside the job's" in said[0]
    assert job.server.refusals.count == 5


def test_a_client_without_the_secret_is_told_what_is_missing(monkeypatch):
    monkeypatch.delenv("ELASTIC_STORE_SECRET", raising=False)
    with pytest.raises(RuntimeError, match=r"\$ELASTIC_STORE_SECRET is not set.*elastic-launch starts"):
        Control("127.0.0.1", 1)


def test_refusals_are_said_at_most_once_a_second_with_how_many_more():
    now, said = [0.0], []
    log = RefusalLog(said.append, clock=lambda: now[0])
    for t in (0.0, 0.1, 0.2, 0.5, 1.2, 1.3, 5.0):
        now[0] = t
        log("10.0.0.9:4242", "not a TCPStore client")
    assert log.count == 7
    assert [line.rsplit(":", 1)[1] for line in said] == [
        " not a TCPStore client", " not a TCPStore client (3 more refused since the last line)",
        " not a TCPStore client (1 more refused since the last line)"]
