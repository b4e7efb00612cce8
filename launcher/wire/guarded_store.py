"""The control plane's store server: torch's TCPStore protocol, answering only clients that know the job's secret.

Why: torch's own server answers whoever reaches its port. A stranger's plain TCPStore client could read
every key (`list_keys`), post events, settle steps "no" or mark a world aborted, and the job would stop
training without a word (measured: one `set("abort/w0")` froze a pp2dp2 job). A TCPStore client cannot
send a credential, but every key it names can carry one: the job's clients put all their keys under the
job's secret (a `PrefixStore` of ELASTIC_STORE_SECRET, which the launcher hands its workers in the
environment srun passes, never on a command line that `ps` shows), and this server closes the connection
of any request that names a key outside it, or that names no key and would tell about all of them (the
number of keys, their list, a barrier). So a stranger's connection ends at its first request, having read
and changed nothing, and the launcher is told (`on_refused`).

Restart mode's rendezvous runs the same server without a secret, for the user's script (env:// sends
none): there `admit` decides per connection (launcher.wire.local_peer) and the key count and list are served.

The server is Python (asyncio, one thread): what the store carries per step no longer grows with the job
(launcher.runtime.vote), so a few thousand requests a second are enough (`elastic bench-control` measures
it at 4,096 ranks). Semantics are torch's libuv server's, request for request; the queue requests are not served (the
control plane and torch's process groups do not use them).
"""
from __future__ import annotations

import asyncio
import hmac
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Callable

from launcher.wire.listen import bound_listener

MAGIC = 0x3C85F7CE  # what a torch client sends first (c10d::detail::validationMagicNumber)
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET,
 CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS, BARRIER) = range(19)  # c10d::detail::QueryType
READY, NOT_READY = b"\x00", b"\x01"  # CheckResponseType
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"  # WaitResponseType
MAX_KEY = 64 * 1024  # a longer key is no client of ours
MAX_PAYLOAD = 1 << 30
MAX_KEYS = 1 << 20
_U64, _I64, _U32 = struct.Struct("<Q"), struct.Struct("<q"), struct.Struct("<I")
UNSERVED = {GETNUMKEYS: "the number of keys", LIST_KEYS: "the list of keys", BARRIER: "a barrier",
            QUEUE_PUSH: "a queue", QUEUE_POP: "a queue", QUEUE_LEN: "a queue"}


def new_secret() -> str:
    return secrets.token_hex(16)


class _Incomplete(Exception):
    """The request has not arrived whole yet."""


class _Refused(Exception):
    """The request is not the job's: the connection ends."""


class _Reader:
    def __init__(self, buf: bytearray) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if len(self.buf) - self.pos < n:
            raise _Incomplete
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def u64(self, most: int) -> int:
        n = _U64.unpack(self.take(8))[0]
        if n > most:
            raise _Refused(f"a length of {n} (at most {most})")
        return n

    def i64(self) -> int:
        return _I64.unpack(self.take(8))[0]

    def blob(self) -> bytes:
        return self.take(self.u64(MAX_PAYLOAD))


def _blob(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


class _Keys:
    """The data and who waits for what: touched only on the server's one thread."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.waiting: dict[bytes, list[_Client]] = {}
        self.clients: set[_Client] = set()

    def put(self, key: bytes, value: bytes) -> None:
        self.data[key] = value
        self.wake(key)

    def wake(self, key: bytes) -> None:
        for client in self.waiting.pop(key, ()):
            client.awaited -= 1
            if client.awaited == 0:
                client.send(STOP_WAITING)

    def forget(self, client: "_Client") -> None:
        if client.awaited:
            for key in [k for k, cs in self.waiting.items() if client in cs]:
                self.waiting[key] = [c for c in self.waiting[key] if c is not client]
                if not self.waiting[key]:
                    del self.waiting[key]
            client.awaited = 0


class _Client(asyncio.Protocol):
    def __init__(self, keys: _Keys, prefix: bytes | None, refused: Callable[[str, str], None],
                 admit: Callable[[tuple, tuple], str | None] | None) -> None:
        self.keys, self.prefix, self.refused, self.admit = keys, prefix, refused, admit
        self.buf = bytearray()
        self.validated = False
        self.awaited = 0  # keys this client's WAIT still waits for
        self.transport: asyncio.Transport | None = None
        self.peer = "?"

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.keys.clients.add(self)
        why = self.admit(peer, transport.get_extra_info("sockname")) if self.admit and peer else None
        if why is not None:
            self.refused(self.peer, why)
            transport.close()
            self.transport = None

    def connection_lost(self, exc) -> None:
        self.keys.forget(self)
        self.keys.clients.discard(self)
        self.transport = None

    def send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.buf and self.transport is not None:
            reader = _Reader(self.buf)
            try:
                self._serve(reader)
            except _Incomplete:
                return
            except _Refused as why:
                self.refused(self.peer, str(why))
                self.transport.close()
                self.transport = None
                return
            del self.buf[:reader.pos]

    def _key(self, r: _Reader) -> bytes:
        key = r.take(r.u64(MAX_KEY))
        if self.prefix is not None and not hmac.compare_digest(key[:len(self.prefix)], self.prefix):
            raise _Refused(f"key {key[:40]!r} outside the job's")
        return key

    def _serve(self, r: _Reader) -> None:
        query = r.u8()
        if not self.validated:
            if query != VALIDATE or r.u32() != MAGIC:
                raise _Refused("not a TCPStore client")
            self.validated = True
            return
        keys, data = self.keys, self.keys.data
        if query == SET:
            key = self._key(r)
            keys.put(key, r.blob())
        elif query == GET:
            self.send(_blob(data.get(self._key(r), b"")))
        elif query == ADD:
            key = self._key(r)
            try:
                value = r.i64() + int(data.get(key, b"0"))
            except ValueError:
                raise _Refused(f"an add to key {key[:40]!r}, which holds no number") from None
            keys.put(key, str(value).encode())
            self.send(_I64.pack(value))
        elif query == COMPARE_SET:
            key = self._key(r)
            expected, new = r.blob(), r.blob()
            if key not in data:
                if expected:
                    keys.wake(key)
                    self.send(_blob(expected))  # torch's answer for a missing key: what was expected
                    return
                keys.put(key, new)
            elif data[key] == expected:
                keys.put(key, new)
            else:
                keys.wake(key)
            self.send(_blob(data[key]))
        elif query in (CHECK, WAIT, MULTI_GET):
            wanted = [self._key(r) for _ in range(r.u64(MAX_KEYS))]
            if query == MULTI_GET:
                self.send(b"".join(_blob(data.get(k, b"")) for k in wanted))
            elif query == CHECK:
                self.send(READY if all(k in data for k in wanted) else NOT_READY)
            else:
                missing = [k for k in wanted if k not in data]
                if not missing:
                    self.send(STOP_WAITING)
                for k in missing:
                    keys.waiting.setdefault(k, []).append(self)
                self.awaited = len(missing)
        elif query == MULTI_SET:
            for _ in range(r.u64(MAX_KEYS)):
                key = self._key(r)
                keys.put(key, r.blob())
        elif query == DELETE_KEY:
            self.send(_I64.pack(1 if data.pop(self._key(r), None) is not None else 0))
        elif query == APPEND:
            key = self._key(r)
            keys.put(key, data.get(key, b"") + r.blob())
        elif query == CANCEL_WAIT:
            keys.forget(self)
            self.send(WAIT_CANCELED)
        elif query == PING:
            self.send(_U32.pack(r.u32()))
        elif query == GETNUMKEYS and self.prefix is None:
            self.send(_I64.pack(len(data)))
        elif query == LIST_KEYS and self.prefix is None:
            self.send(_I64.pack(len(data)) + b"".join(_blob(k) for k in data))
        elif query in UNSERVED:
            raise _Refused(f"a request for {UNSERVED[query]}, which the job's clients never send")
        else:
            raise _Refused(f"unknown request {query}")


class RefusalLog:
    """Says each refused connection, at most one line a second (with how many more), so a flood of
    strangers cannot flood the launcher's log."""

    def __init__(self, say: Callable[[str], None], clock=time.monotonic) -> None:
        self.say, self.clock = say, clock
        self.count = 0
        self.unsaid = 0
        self.last = -1e9

    def __call__(self, peer: str, why: str) -> None:
        self.count += 1
        now = self.clock()
        if now - self.last < 1.0:
            self.unsaid += 1
            return
        more = f" ({self.unsaid} more refused since the last line)" if self.unsaid else ""
        self.say(f"control plane: refused a connection from {peer}: {why}{more}")
        self.last, self.unsaid = now, 0


class GuardedStoreServer:
    """A store server on `host`:`port` (0: any free port; `.port` says which). With a `secret`, for clients
    whose keys all start with it (a PrefixStore of `secret`); without one, for every client `admit` lets in
    (`admit(peer address, server address)` -> None, or why not). Runs on its own thread until `close()` or
    until it is garbage."""

    def __init__(self, host: str, port: int, secret: str | None, on_refused: Callable[[str], None] | None = None,
                 admit: Callable[[tuple, tuple], str | None] | None = None) -> None:
        if secret is not None and (not secret or "/" in secret):
            raise ValueError("GuardedStoreServer: the secret must be a non-empty string without '/'")
        self.refusals = RefusalLog(on_refused or (lambda line: None))
        listener = bound_listener(host, port)
        self.port = listener.getsockname()[1]
        loop = asyncio.new_event_loop()
        prefix = None if secret is None else f"/{secret}/".encode()  # a TCPStore client puts "/" first
        keys = self._keys = _Keys()
        refusals = self.refusals
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            server = loop.run_until_complete(loop.create_server(
                lambda: _Client(keys, prefix, refusals, admit), sock=listener, backlog=4096))
            started.set()
            try:
                loop.run_forever()
            finally:
                server.close()
                for client in list(keys.clients):
                    if client.transport is not None:
                        client.transport.close()
                loop.run_until_complete(server.wait_closed())
                loop.close()

        self._thread = threading.Thread(target=run, name="elastic-store", daemon=True)
        self._thread.start()
        started.wait()
        self._finalizer = weakref.finalize(self, _stop, loop, self._thread)

    def key_count(self) -> int:
        return len(self._keys.data)

    def close(self) -> None:
        self._finalizer()


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)
    if thread is not threading.current_thread():
        thread.join(timeout=5)
