"""One process's part of moving tensors between processes: the transfer layer under both migration
engines (migrate.executor runs the reference GPT's Send/Recv/Refer plans on it, migrate.reshard any
model's manifest transfers).

An engine says what this process sends, receives and copies locally (`send`, `recv`, `copy`), each
message with a key that both of its ends give alike; `run` then moves it. Why it is built this way
(gloo over loopback on CPU, where the memory system is the bottleneck):

* No extra copies: a piece goes straight from the old tensor and lands straight in the new one when
  both views are contiguous. Only strided views (a column slice of a row-parallel weight) pass
  through staging buffers, and those are allocated once and reused for every window.
* Coalescing: the pieces under `SMALL_BYTES` between two processes (biases, layer norms) travel as one
  packed message, not dozens of tiny ones.
* Batched per peer, bounded in memory, free of deadlock: a process posts its messages in windows
  (at most `window_bytes` of temporary memory, or of traffic when old tensors are released early) in
  the order of their keys, all of a window at once, and waits for it before posting the next. Every
  process uses the same order, so the globally first pending message is always posted at both ends
  and the transfer always advances; a process never waits for a round it takes no part in.
* Through memory, not sockets, between processes of one host (migrate.cma, `_Reads`): a receiver
  reads an unpacked message straight out of its sender's memory (one copy instead of a socket's two,
  no I/O thread), or in safe mode a sender writes a strided one into the receiver's contiguous new
  tensor; each pair agrees at the start of a run, and one that may not keeps the sockets.
* Built before the pause (`prepare`): messages, windows and staging worked out, every view cut and
  bound to its staging region, every view a peer may read described, while the old layout still
  trains; inside the pause a staged message is packed and unpacked with one foreach copy, and a
  message through memory is copied, digested and written (or read, digested and unpacked) while its
  bytes are in the cache. Peers may be given by name (`prepare(me=...)`, `run(ranks=...)`), since the
  process group of the pause does not exist yet.
* Release early (optional): an old tensor ("owner") is handed to `release` once every use of it is
  done and its receivers confirmed, with xxh3 digests of what arrived (migrate.checksum), that the
  new copy equals what was sent; an owner no message or copy uses is released at once (another
  live copy serves it). The engine drops its references there, so peak memory stays near one copy.
  Without it, nothing old is touched: a failure half way leaves the old state intact.
* Digests of every message (optional, `digests=True`: what migrate.reshard verifies), one per message,
  not per piece (a packed message holds dozens of small pieces; per-piece digests cost more Python
  than hashing): the sender's from the contiguous bytes it hands over (the piece itself, or its
  staging region right after packing), while its window's messages are in flight; the receiver's from
  the bytes that arrived: a staged message's staging region as it lands, a direct one from its final
  new tensor once everything landed (a later write over it is caught too). `compare` then checks
  them per pair of processes. A local `copy` moves nothing between processes and is not digested.
  With release early every message is digested as it lands and confirmed to its sender after the
  window (one vector per peer and window, not a second hash of the whole buffer).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from migrate import cma
from migrate.checksum import unit_digest

#: pieces below this size between two processes travel in one packed message
SMALL_BYTES = 64 << 10
#: temporary memory one window may hold (safe mode: the new state is whole in memory anyway)
WINDOW_BYTES = 64 << 20
#: traffic one window may hold when old tensors are released early (little new before old goes)
EARLY_WINDOW_BYTES = 4 << 20


class TransferError(RuntimeError):
    """The transfer did not complete (a peer died, a digest differed)."""


#: tag of the digest confirmations, apart from the data's (gloo matches messages per pair and tag, in order)
ACK_TAG = 7
#: tags of cross-memory reads (migrate.cma): a sender's descriptions of its views, the receiver's answer
#: (it reads them or not), its "done", and the sender's "written" (one tag each: a pair's two directions
#: carry them at once)
DESC_TAG, ANSWER_TAG, DONE_TAG, WRITTEN_TAG = 8, 9, 10, 11
#: int64 slots of one view's description: address, block, k, then up to 8 (count, stride)
DESC_SLOTS = 3 + 2 * 8
#: new tensors this process told a peer to write into, not yet confirmed written: a run that fails
#: leaves them here, so that a writer still at work never writes into memory given to something else.
#: The next run lets them go: a runtime starts a migration only once every participant of the last
#: one has reported or died, so no writer of a failed run is still writing by then.
AWAITED_WRITES: list[torch.Tensor] = []


@dataclass
class _Piece:
    """A send's source view, or a receive's target view (or how to make it: targets can be allocated
    only when their window comes, so that memory released early is not needed twice)."""

    source: torch.Tensor | Callable[[], torch.Tensor]
    nbytes: int
    contiguous: bool
    owner: Hashable | None = None  # the old tensor a send reads, for release-early bookkeeping
    key: Hashable | None = None  # the piece's name, reported when its message's digests differ

    @property
    def tensor(self) -> torch.Tensor:
        if callable(self.source):
            self.source = self.source()
        return self.source


@dataclass
class _Message:
    key: tuple
    peer: int  # rank in the group
    outgoing: bool
    pieces: list[_Piece]
    nbytes: int
    temp: int  # bytes of staging or contiguous copy it needs
    owners: set = field(default_factory=set)
    cma: bool = False  # read by the receiver straight from the sender's memory (migrate.cma)
    push: int = 0  # instead written by the sender into the receiver's memory: there, at this address
    # bound to its tensors (Exchange._bind): the contiguous bytes handed over or landing (a piece itself,
    # or its staging region), and for a staged message the (destinations, sources) of one foreach copy
    buf: torch.Tensor | None = None
    pack: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    desc: list[int] | None = None  # an outgoing unpacked message's view described ahead (migrate.cma.describe)


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    windows: int = 0
    released: int = 0
    staging_bytes: int = 0
    final_digest_s: float = 0.0  # seconds spent digesting direct messages' new tensors after the last window
    staging_fresh: int = 0  # staging bytes allocated during the run (the buffers given ahead were too small)
    cma_bytes: int = 0  # of bytes_sent + bytes_received, those moved through processes' memory (migrate.cma)
    cma_written: int = 0  # of cma_bytes, those the sender wrote (strided at the sender, contiguous at the receiver)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def narrow_is_contiguous(shape: tuple[int, ...], dim: int, length: int) -> bool:
    """Whether `t.narrow(dim, start, length)` of a contiguous tensor `t` of `shape` is contiguous,
    without a tensor: the cut spans the whole dimension, or every dimension before it has one index."""
    return view_is_contiguous(shape, tuple(length if d == dim else s for d, s in enumerate(shape)))


def view_is_contiguous(shape: tuple[int, ...], lengths: tuple[int, ...]) -> bool:
    """Whether the box of `lengths` elements along every dimension of a contiguous tensor of `shape` is a
    contiguous view: empty, or, past its first dimension with more than one index, whole."""
    if 0 in lengths:
        return True
    d = next((i for i, n in enumerate(lengths) if n > 1), len(lengths))
    return all(n == s for n, s in zip(lengths[d + 1:], shape[d + 1:]))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def signed64(d: int) -> int:
    """An unsigned 64-bit digest as the int64 a tensor carries."""
    return d - (1 << 64) if d >= 1 << 63 else d


class Exchange:
    """What one process sends, receives and copies in one transfer; `run` moves it.

    `group`: the process group every participant uses (None: the default world); peers are ranks in
    it. Every participant must describe its part with the same keys and call `run`."""

    def __init__(self, group=None, window_bytes: int = WINDOW_BYTES, release: Callable[[Hashable], None] | None = None,
                 small_bytes: int = SMALL_BYTES, digests: bool = False) -> None:
        self.group, self.window_bytes, self.release, self.small_bytes = group, window_bytes, release, small_bytes
        self._sends: dict[int, list[tuple[tuple, _Piece]]] = {}
        self._recvs: dict[int, list[tuple[tuple, _Piece]]] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor, Hashable | None]] = []
        # digests=True (and release early): unit_digest of the bytes of every message sent (`sent`) and
        # received (`got`), by message key
        self.digests = digests
        self.sent: dict[tuple, int] = {}
        self.got: dict[tuple, int] = {}
        self._direct: list[_Message] = []  # received straight into new tensors, digested after the last window
        self._msgs: list[_Message] = []  # this run's messages, for `compare`
        self._uses: dict[Hashable, int] = {}
        self.stats = TransferStats()
        self._plan: tuple[list[list[_Message]], torch.Tensor, torch.Tensor] | None = None  # prepare's windows, staging

    # -- describing the transfer ---------------------------------------------------------------
    def own(self, owner: Hashable) -> None:
        """Declare an old tensor that may be released early (release mode), even if nothing reads it."""
        self._uses.setdefault(owner, 0)

    def send(self, peer: int, key: tuple, t: torch.Tensor, owner: Hashable | None = None) -> None:
        """Send view `t` (of old tensor `owner`) to `peer`; the receiver gives the same `key`."""
        self._sends.setdefault(peer, []).append((key, _Piece(t, _bytes(t), t.is_contiguous(), owner, key)))
        if owner is not None:
            self._uses[owner] = self._uses.get(owner, 0) + 1

    def recv(self, peer: int, key: tuple, t: torch.Tensor | Callable[[], torch.Tensor], nbytes: int | None = None,
             contiguous: bool | None = None) -> None:
        """Receive into view `t`, or into what `t()` returns when its window comes (then give its
        `nbytes` and whether it is `contiguous`)."""
        if not callable(t):
            nbytes, contiguous = _bytes(t), t.is_contiguous()
        self._recvs.setdefault(peer, []).append((key, _Piece(t, nbytes, contiguous, None, key)))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, owner: Hashable | None = None) -> None:
        """Copy view `src` (of old tensor `owner`) into view `dst` in this process."""
        self._copies.append((dst, src, owner))
        if owner is not None:
            self._uses[owner] = self._uses.get(owner, 0) + 1

    # -- planning the messages (pure) ----------------------------------------------------------
    def _messages(self, me: tuple[Hashable, Hashable]) -> list[_Message]:
        out: list[_Message] = []
        for outgoing, table in ((True, self._sends), (False, self._recvs)):
            for peer, items in table.items():
                items.sort(key=lambda kp: kp[0])
                small = [p for k, p in items if p.nbytes < self.small_bytes]
                if small:  # one packed message per pair, first in the pair's order
                    n = sum(p.nbytes for p in small)
                    ends = (me[0], peer) if outgoing else (peer, me[1])
                    out.append(_Message((0, *ends), peer, outgoing, small, n, n))
                for k, p in items:
                    if p.nbytes >= self.small_bytes:
                        out.append(_Message((1, k), peer, outgoing, [p], p.nbytes, 0 if p.contiguous else p.nbytes))
        for m in out:
            m.owners = {p.owner for p in m.pieces if p.owner is not None}
        out.sort(key=lambda m: m.key)
        return out

    def _windows(self, msgs: list[_Message]) -> list[list[_Message]]:
        count_all = self.release is not None
        windows: list[list[_Message]] = [[]]
        load = 0
        for m in msgs:
            cost = m.nbytes if count_all else m.temp
            if windows[-1] and load + cost > self.window_bytes:
                windows.append([])
                load = 0
            windows[-1].append(m)
            load += cost
        return [w for w in windows if w]

    # -- moving ----------------------------------------------------------------------------------
    def prepare(self, staging: tuple[torch.Tensor, torch.Tensor] | None = None,
                me: tuple[Hashable, Hashable] | None = None) -> None:
        """Everything `run` does that reads and writes no tensor's values: the messages, their windows and
        staging, and (safe mode, where every new tensor exists) each message bound to its views, and the
        views other processes may read described (migrate.cma). A runtime calls it before the pause, while
        the old layout still trains, on views of the very tensors it will move: inside the pause, cutting,
        packing and describing thousands of views one Python call at a time cost more than moving the
        bytes (pp4tp2dp3 -> pp4tp8dp1: ~7,000 pieces over 32 processes). `staging`: as `run`'s. `me`:
        the names this process goes by as a sender and as a receiver, where peers are given by name
        (then `run` maps names to ranks); by default its rank in the group, both."""
        if me is None:
            r = dist.get_rank(self.group)
            me = (r, r)
        self._msgs = self._messages(me)
        windows = self._windows(self._msgs)
        temp_in = max((sum(m.temp for m in w if not m.outgoing) for w in windows), default=0)
        temp_out = max((sum(m.temp for m in w if m.outgoing) for w in windows), default=0)
        device = self._device()
        have_in, have_out = staging if staging is not None else (None, None)
        staging_in, fresh_in = _staging(have_in, temp_in, device)
        staging_out, fresh_out = _staging(have_out, temp_out, device)
        self.stats.staging_bytes, self.stats.staging_fresh = temp_in + temp_out, fresh_in + fresh_out
        self._plan = (windows, staging_in, staging_out)
        for m in self._msgs:  # what a peer reading it through memory is told (_Reads)
            if m.outgoing and m.key[0] == 1:
                m.desc = cma.describe(m.pieces[0].tensor)
        if self.release is None:  # every new tensor exists already
            for window in windows:
                self._bind_window(window, staging_in, staging_out)

    def run(self, on_window: Callable[[int], None] | None = None,
            staging: tuple[torch.Tensor, torch.Tensor] | None = None,
            ranks: Mapping[Hashable, int] | None = None) -> TransferStats:
        """Copy locally, then move every message; raises TransferError when a peer fails. `staging`: uint8
        buffers (received, sent) allocated and written ahead (migrate.reshard.allocate_staging), used where
        large enough: strided and packed pieces pass through them, and a kernel receiving into fresh
        memory zeroes every page first (a quarter of the CPU of a pp4tp4 -> pp4tp2 transfer). Prepares
        what `prepare` did not yet; `ranks`: the rank in the group of each peer named in `prepare`."""
        if self.release is None:
            if self._copies:
                torch._foreach_copy_([dst for dst, _s, _o in self._copies], [src for _d, src, _o in self._copies])
            self._copies.clear()
        else:
            for dst, src, owner in self._copies:
                dst.copy_(src)  # each old tensor released as soon as its last use is done
                self._used(owner)
            self._copies.clear()  # a view keeps its old tensor's memory alive: drop it once used
            for owner, uses in list(self._uses.items()):  # owners no message uses
                if uses == 0:
                    self._release(owner)
        if self._plan is None:
            self.prepare(staging)
        windows, staging_in, staging_out = self._plan
        if ranks is not None:
            for m in self._msgs:
                m.peer = ranks[m.peer]
        acks = _Acks(self.group)  # release mode: confirmations of what arrived
        reads = None
        AWAITED_WRITES.clear()
        try:
            reads = _Reads(self.group, self._msgs if self._may_read() else [], push=self.release is None)
            for i, window in enumerate(windows):
                if on_window is not None:
                    on_window(i)
                if window[0].buf is None:  # release mode: new tensors made only now
                    self._bind_window(window, staging_in, staging_out)
                self._window(window, acks, reads)
                self._settle(acks, wait=False)
            self._settle(acks, wait=True)
            reads.finish()
            if self._direct:  # what sits in the new tensors now, after every write
                t0 = time.perf_counter()
                for m in self._direct:
                    self.got[m.key] = unit_digest(m.buf)
                self._direct.clear()
                self.stats.final_digest_s = time.perf_counter() - t0
        except Exception as exc:
            if reads is not None:
                reads.abandon()
            if isinstance(exc, TransferError):
                raise
            # a dead peer shows up here as a gloo error
            raise TransferError(f"{type(exc).__name__}: {exc}") from exc
        self.stats.windows = len(windows)
        return self.stats

    def compare(self) -> tuple[list[Hashable], int]:
        """After `run` with digests: every sender hands each receiver its messages' digests (one int64
        vector per pair of processes, in key order), and the receiver compares them with what arrived.
        Returns the keys of the pieces received here in messages that differ, and how many pieces were
        received and checked here. Every participant calls it."""
        out: dict[int, list[_Message]] = {}
        into: dict[int, list[_Message]] = {}
        for m in self._msgs:
            (out if m.outgoing else into).setdefault(m.peer, []).append(m)
        ex = Exchange(self.group)
        for peer, ms in out.items():
            ex.send(peer, ("digests",), torch.tensor([signed64(self.sent[m.key]) for m in ms], dtype=torch.int64))
        boxes = {peer: torch.zeros(len(ms), dtype=torch.int64) for peer, ms in into.items()}
        for peer, box in boxes.items():
            ex.recv(peer, ("digests",), box)
        ex.run()
        bad = [p.key for peer, ms in into.items() for m, d in zip(ms, boxes[peer].tolist())
               if d != signed64(self.got[m.key]) for p in m.pieces]
        return bad, sum(len(m.pieces) for ms in into.values() for m in ms)

    def _may_read(self) -> bool:
        """Whether messages may go by cross-memory read (migrate.cma): on gloo, where tensors are on the
        CPU; the same answer for every member of the group."""
        return dist.is_initialized() and dist.get_backend(self.group) == "gloo"

    def _device(self) -> torch.device:
        for items in self._sends.values():
            return items[0][1].tensor.device
        for items in self._recvs.values():
            if not callable(items[0][1].source):
                return items[0][1].source.device
        return torch.device("cuda", torch.cuda.current_device()) \
            if dist.is_initialized() and dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def _bind_window(self, window: list[_Message], staging_in: torch.Tensor, staging_out: torch.Tensor) -> None:
        """Bind each message of `window` to its tensors (`_Message.buf`, `pack`): a window's staged
        messages take its staging buffers in order, from the start."""
        off = {True: 0, False: 0}
        for m in window:
            if not m.temp:
                m.buf = _flat(m.pieces[0].tensor)
                continue
            staging = staging_out if m.outgoing else staging_in
            m.buf = staging[off[m.outgoing]:off[m.outgoing] + m.nbytes]
            off[m.outgoing] += m.nbytes
            views, pieces, pos = [], [], 0
            for p in m.pieces:
                t = p.tensor
                views.append(m.buf[pos:pos + p.nbytes].view(t.dtype).view(t.shape))
                pieces.append(t)
                pos += p.nbytes
            m.pack = (views, pieces) if m.outgoing else (pieces, views)

    def _window(self, window: list[_Message], acks: "_Acks", reads: "_Reads") -> None:
        ops, unpack, sent, read = [], [], [], []
        digest = self.digests or self.release is not None
        for m in window:
            buf = m.buf
            if m.outgoing:
                if not m.cma:  # over the socket, posted first
                    if m.pack is not None:  # packed small pieces, or a strided view: one contiguous copy
                        torch._foreach_copy_(*m.pack)
                    ops.append(dist.isend(buf, group=self.group, group_dst=m.peer))
                if not m.cma or m.push or digest:  # else the receiver reads the view itself, untouched here
                    sent.append(m)
                self.stats.bytes_sent += m.nbytes
            else:
                unpack.append(m)
                if m.cma:
                    if not m.push:  # else the sender writes it
                        read.append((m, buf))
                else:
                    ops.append(dist.irecv(buf, group=self.group, group_src=m.peer))
                self.stats.bytes_received += m.nbytes
            self.stats.messages += 1
            if m.cma:
                self.stats.cma_bytes += m.nbytes
                self.stats.cma_written += m.nbytes if m.push else 0
        # the sender's digests, from the bytes on their way (in flight meanwhile); a message through memory
        # copied, digested and written one after the other, while its bytes are in the cache
        for m in sent:
            if m.cma and m.pack is not None:
                torch._foreach_copy_(*m.pack)
            if digest:
                self.sent[m.key] = unit_digest(m.buf)
            if m.push:
                reads.write(m, m.buf)
        for m, buf in read:  # while the socket messages are in flight; each digested and unpacked while in cache
            reads.read(m, buf)
            self._landed(m, digest)
        for op in ops:
            op.wait()
        for m in unpack:
            if not m.cma:
                self._landed(m, digest)
            elif m.push and digest:  # written by its sender: digested once every writer said "written"
                self._direct.append(m)
            if self.release is not None:  # confirmed to the sender after the window, in the pair's order
                acks.landed(m.peer, [self.got[m.key]])
        if self.release is None:
            return
        acks.confirm()
        for m in sent:
            acks.expect(m, [self.sent[m.key]])

    def _landed(self, m: _Message, digest: bool) -> None:
        """Message `m` arrived: a staged one is digested as it arrived and unpacked into its new tensors;
        a direct one is digested now with release early (confirmed after its window, not at the end),
        else from its new tensor after the last window (a later write over it is caught too)."""
        if m.pack is not None:
            if digest:
                self.got[m.key] = unit_digest(m.buf)
            torch._foreach_copy_(*m.pack)
        elif self.release is not None:
            self.got[m.key] = unit_digest(m.buf)
        elif digest:
            self._direct.append(m)

    def _settle(self, acks: "_Acks", wait: bool) -> None:
        """Release the owners whose receivers confirmed their pieces (release mode)."""
        for m in acks.confirmed(wait):
            for p in m.pieces:
                self._used(p.owner)
                p.source = None  # the view would keep the released old tensor's memory alive
            m.buf = m.pack = None

    def _used(self, owner: Hashable | None) -> None:
        if owner is None or owner not in self._uses:
            return
        self._uses[owner] -= 1
        if self._uses[owner] == 0 and self.release is not None:
            self._release(owner)

    def _release(self, owner: Hashable) -> None:
        self._uses.pop(owner, None)
        self.stats.released += 1
        self.release(owner)


def _staging(have: torch.Tensor | None, n: int, device) -> tuple[torch.Tensor, int]:
    """n bytes of staging: a view of `have` (allocated ahead) when it is large enough, else fresh memory;
    and how many bytes were allocated now."""
    if have is not None and have.numel() >= n:
        return have[:n], 0
    return torch.empty(n, dtype=torch.uint8, device=device), n


def staging_bound(pieces: Iterable[tuple[bool, Hashable, int, bool]], window_bytes: int = WINDOW_BYTES,
                  small_bytes: int = SMALL_BYTES) -> tuple[int, int]:
    """Staging bytes (received, sent) a `run` may need at most, from its pieces (incoming, peer, bytes,
    contiguous) alone, before any tensor exists: packed small pieces and strided pieces pass through
    staging (the rule of `_messages`), at most one window of them at a time (`_windows`), or one message
    larger than a window, alone in its own."""
    small: dict[tuple[bool, Hashable], int] = {}
    big: dict[bool, list[int]] = {True: [], False: []}
    for incoming, peer, n, contiguous in pieces:
        if n < small_bytes:
            small[incoming, peer] = small.get((incoming, peer), 0) + n
        elif not contiguous:
            big[incoming].append(n)
    out = []
    for incoming in (True, False):
        temps = big[incoming] + [n for (i, _p), n in small.items() if i == incoming]
        out.append(min(sum(temps), max([window_bytes, *temps])))
    return out[0], out[1]


def _combined(digests: list[int]) -> int:
    """One int64 for a run of messages' digests (xxh3 of them in order): what an acknowledgement carries."""
    import xxhash

    return signed64(xxhash.xxh3_64_intdigest(str(digests).encode()))


class _Acks:
    """Release mode's confirmations, one message per peer and window, not one per message (each message
    on loopback costs tens of microseconds of CPU at both ends). A receiver confirms, after each of its
    windows, every message it got from a peer in that window with [count, combined digests]; the sender
    keeps its sent messages per peer in order (both ends order them alike) and, for each acknowledgement,
    checks the next `count` of them and hands them back for release. Windows differ between the two
    ends, so the count travels with the digest."""

    def __init__(self, group) -> None:
        self.group = group
        self._got: dict[int, list[int]] = {}  # peer -> digests landed this window, not yet confirmed
        self._counts: dict[int, int] = {}
        self._out: list[tuple[object, torch.Tensor]] = []  # acknowledgements on their way
        self._pending: dict[int, list[tuple[_Message, list[int]]]] = {}  # peer -> sent, unconfirmed (in order)
        self._box: dict[int, tuple[object, torch.Tensor]] = {}  # peer -> the posted receive of its next ack

    def landed(self, peer: int, digests: list[int]) -> None:
        self._got.setdefault(peer, []).extend(digests)
        self._counts[peer] = self._counts.get(peer, 0) + 1

    def confirm(self) -> None:
        """Send this window's acknowledgements."""
        for peer, digests in self._got.items():
            ack = torch.tensor([self._counts[peer], _combined(digests)], dtype=torch.int64)
            self._out.append((dist.isend(ack, group=self.group, group_dst=peer, tag=ACK_TAG), ack))
        self._got.clear()
        self._counts.clear()

    def expect(self, m: _Message, digests: list[int]) -> None:
        self._pending.setdefault(m.peer, []).append((m, digests))
        self._post(m.peer)

    def _post(self, peer: int) -> None:
        if peer not in self._box and self._pending.get(peer):
            box = torch.zeros(2, dtype=torch.int64)
            self._box[peer] = (dist.irecv(box, group=self.group, group_src=peer, tag=ACK_TAG), box)

    def confirmed(self, wait: bool) -> list[_Message]:
        """Sent messages whose receivers confirmed them since the last call (wait: every one, and every
        acknowledgement this process sent has left). Raises TransferError when a digest differs."""
        done: list[_Message] = []
        while self._box:
            for peer, (req, box) in list(self._box.items()):
                if not wait and not req.is_completed():
                    continue
                req.wait()
                del self._box[peer]
                count, got = (int(x) for x in box.tolist())
                run, self._pending[peer] = self._pending[peer][:count], self._pending[peer][count:]
                if len(run) != count or _combined([d for _m, ds in run for d in ds]) != got:
                    raise TransferError(f"rank {peer} received a piece that differs from what was sent (digest)")
                done += [m for m, _ds in run]
                self._post(peer)
            if not wait:
                break
        if wait:
            for req, _ack in self._out:
                req.wait()
            self._out.clear()
        return done


class _Reads:
    """One run's cross-memory reads and writes (migrate.cma), agreed per pair of processes at the start.
    A sender hands each peer it sends unpacked messages to its `identity` and a description of every
    such view, in key order (both ends order them alike); the receiver decides whether it may read that
    peer (migrate.cma.readable) and answers, with its pid; from then on both ends treat that pair's
    unpacked messages alike: through memory, or over the socket. Through memory the receiver reads a
    view, but one whose source is strided (a column slice: runs of a few hundred bytes, each of which
    costs the kernel a page walk in the other process) lands in a contiguous new tensor (`push`, safe
    mode: the new tensors exist from the start): the receiver answers that tensor's address instead,
    and the sender writes its contiguous staging copy there. At the end a reader tells each peer it read
    that it is done, and a sender that wrote tells each peer it wrote to; each waits for what it is
    owed before it returns: a sender's memory is left untouched until its readers are done (in safe
    mode the old state lives on anyway, with release early an old tensor goes only once its reader
    confirmed what it read), and a receiver digests its new tensors only once they are written; one that
    fails keeps the tensors it offered to writers alive (`AWAITED_WRITES`) until its next run. Every
    message posted before any wait: free of deadlock, and a process that takes no part in a pair's
    messages takes none in its handshake."""

    def __init__(self, group, msgs: list[_Message], push: bool) -> None:
        self.group = group
        me = cma.identity()
        outgoing: dict[int, list[_Message]] = {}
        incoming: dict[int, list[_Message]] = {}
        for m in msgs:
            if m.key[0] == 1:  # packed messages stay on the socket
                (outgoing if m.outgoing else incoming).setdefault(m.peer, []).append(m)
        self._sent: list[tuple[object, torch.Tensor]] = []  # descriptions, answers and flags on their way
        answers: dict[int, tuple[object, torch.Tensor]] = {}
        for peer, ms in outgoing.items():
            values = list(me)
            for m in ms:
                d = m.desc  # described by `prepare`
                if len(d) > DESC_SLOTS:
                    raise TransferError(f"{m.pieces[0].key}: a view of {len(d)} description slots, at most "
                                        f"{DESC_SLOTS}; set ${cma.ENV_CMA}=0 to move it over sockets")
                values += d + [0] * (DESC_SLOTS - len(d))
            desc = torch.tensor(values, dtype=torch.int64)
            self._sent.append((dist.isend(desc, group=group, group_dst=peer, tag=DESC_TAG), desc))
            box = torch.zeros(2 + len(ms), dtype=torch.int64)  # [may, pid, where to write each or 0]
            answers[peer] = (dist.irecv(box, group=group, group_src=peer, tag=ANSWER_TAG), box)
        descs = {}
        for peer, ms in incoming.items():
            box = torch.zeros(len(me) + len(ms) * DESC_SLOTS, dtype=torch.int64)
            descs[peer] = (dist.irecv(box, group=group, group_src=peer, tag=DESC_TAG), box)
        self.pids: dict[int, int] = {}  # the peers this process reads or writes, with their pids
        self._queue: dict[int, list[list[int]]] = {}
        self._owed: dict[int, tuple[object, torch.Tensor]] = {}  # peer -> the posted receive of its "written"
        for peer, (req, box) in descs.items():  # as a receiver: decide, answer
            req.wait()
            values = box.tolist()
            them, rows = values[:len(me)], values[len(me):]
            ok = cma.readable(me, them)
            answer = [int(ok), me[-1]] + [0] * len(incoming[peer])
            if ok:
                self.pids[peer] = them[-1]
                queue = []
                for i, m in enumerate(incoming[peer]):
                    row = rows[i * DESC_SLOTS:(i + 1) * DESC_SLOTS]
                    m.cma = True
                    if push and row[2] and not m.temp:  # strided there, contiguous here: written by the sender
                        AWAITED_WRITES.append(m.pieces[0].tensor)
                        m.push = answer[2 + i] = m.pieces[0].tensor.data_ptr()
                    else:
                        queue.append(row[:3 + 2 * row[2]])
                self._queue[peer] = queue[::-1]
                if any(m.push for m in incoming[peer]):
                    flag = torch.zeros(1, dtype=torch.int64)
                    self._owed[peer] = (dist.irecv(flag, group=group, group_src=peer, tag=WRITTEN_TAG), flag)
            answer = torch.tensor(answer, dtype=torch.int64)
            self._sent.append((dist.isend(answer, group=group, group_dst=peer, tag=ANSWER_TAG), answer))
        self._done: dict[int, tuple[object, torch.Tensor]] = {}  # peer -> the posted receive of its "done"
        self._written: list[int] = []  # the peers to tell "written"
        for peer, (req, box) in answers.items():  # as a sender: learn the answer
            req.wait()
            values = box.tolist()
            if values[0]:
                self.pids[peer] = values[1]
                for m, where in zip(outgoing[peer], values[2:]):
                    m.cma, m.push = True, where
                done = torch.zeros(1, dtype=torch.int64)
                self._done[peer] = (dist.irecv(done, group=group, group_src=peer, tag=DONE_TAG), done)
                if any(values[2:]):
                    self._written.append(peer)
        self._readers = list(descs.keys() & self.pids.keys())  # the peers to tell "done"

    def read(self, m: _Message, into: torch.Tensor) -> None:
        """Read message `m` from its sender's memory into contiguous `into` (messages of a peer in key order)."""
        try:
            cma.read(self.pids[m.peer], into, self._queue[m.peer].pop())
        except OSError as exc:
            raise TransferError(f"could not read the memory of rank {m.peer} (pid {self.pids[m.peer]}): {exc}; "
                                f"set ${cma.ENV_CMA}=0 to move every message over sockets") from exc

    def write(self, m: _Message, buf: torch.Tensor) -> None:
        """Write message `m`'s contiguous bytes `buf` where its receiver answered."""
        try:
            cma.write(self.pids[m.peer], buf, m.push)
        except OSError as exc:
            raise TransferError(f"could not write into the memory of rank {m.peer} (pid {self.pids[m.peer]}): "
                                f"{exc}; set ${cma.ENV_CMA}=0 to move every message over sockets") from exc

    def _tell(self, flag: int) -> list:
        told = []
        for peers, tag in ((self._readers, DONE_TAG), (self._written, WRITTEN_TAG)):
            for peer in peers:
                box = torch.tensor([flag], dtype=torch.int64)
                told.append((dist.isend(box, group=self.group, group_dst=peer, tag=tag), box))
        self._readers, self._written = [], []
        self._sent += told
        return told

    def finish(self) -> None:
        """Tell every peer read that this process is done with its memory, and every peer written to
        that it is written; wait until every reader of this process's memory is done, and every writer
        into it has written."""
        self._tell(0)
        for owed, what in ((self._owed, "write into"), (self._done, "read")):
            for peer, (req, box) in owed.items():
                req.wait()
                if int(box[0]):
                    raise TransferError(f"rank {peer} could not {what} this process's memory (see its log)")
            owed.clear()
        AWAITED_WRITES.clear()  # every writer has written
        for req, _t in self._sent:
            req.wait()
        self._sent.clear()

    def abandon(self) -> None:
        """On a failure: tell the peers not yet told that their memory will not be read (best effort)."""
        from datetime import timedelta

        try:
            for req, _box in self._tell(1):  # on its way before this process moves on (or exits)
                req.wait(timedelta(seconds=5))
        except Exception:  # noqa: BLE001 -- the failure being raised says what went wrong
            pass
