"""Cross-memory attach: a process on the same host reads its peer's tensor straight out of the peer's
memory (Linux `process_vm_readv`), one copy where a loopback socket costs two plus TCP's per-segment
work and a gloo I/O thread on each end. MPI libraries move large messages between ranks of one host
this way (CMA); on this project's 2-core test machine one process reads 4-6 GB/s, about what the 8 to
32 processes of a paper scenario reach together over gloo and loopback.

migrate.transfer uses it for every message between two processes of one host that does not need
packing (`Exchange`): the sender hands the receiver a description of its view (`describe`: address,
contiguous block, strides), the receiver reads it into the buffer it would have received into, and
says when it is done, so the sender's memory stays untouched until then. A strided view (a column
slice of a row-parallel weight) would be read as hundreds of short runs, and the kernel walks the
other process's page tables once per run (0.8 GB/s for runs of 384 bytes against 5 for one block):
in safe mode its sender writes (`write`) its contiguous staging copy into the receiver's new tensor
instead, where the receiver's side of it is contiguous.

Whether two processes may: same kernel boot, same PID namespace, same user, and both able to
(`capable`: not turned off with $ELASTIC_CMA=0, the syscall is allowed, Yama's ptrace_scope is 0 or
absent: under 1, a process reads only its own descendants, and workers are siblings). The sender
hands its `identity` to the receiver with the descriptions, and the receiver answers whether it reads
(`readable`, symmetric); a pair that may not uses the sockets as before. Everything here is pure but
`read` and `write`, the one copy, and the probes of this process's own abilities.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

ENV_CMA = "ELASTIC_CMA"
#: most runs one call reads (Linux's UIO_MAXIOV)
IOV_MAX = 1024


def enabled_from_env(env=os.environ) -> bool:
    """Whether $ELASTIC_CMA allows cross-memory reads (unset or 1: yes, 0: sockets only); ValueError
    that says what is allowed."""
    raw = env.get(ENV_CMA, "").strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise ValueError(f"${ENV_CMA} must be 1 (read peers on the same host straight from their memory, the "
                     f"default) or 0 (every message over sockets), got {raw!r}")


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
_writev = getattr(_libc, "process_vm_writev", None)
for _f in (_readv, _writev):
    if _f is not None:
        _f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        _f.restype = ctypes.c_ssize_t


def _ptrace_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0  # no Yama: the classic rule (same user) applies


def _syscall_works() -> bool:
    """Reads 8 bytes of this process's own memory (a seccomp filter or an old kernel refuses it)."""
    if _readv is None:
        return False
    src, dst = ctypes.c_uint64(0x5EED), ctypes.c_uint64(0)
    local, remote = _IOVec(ctypes.addressof(dst), 8), _IOVec(ctypes.addressof(src), 8)
    return _readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 8 and dst.value == 0x5EED


def capable(env=os.environ) -> bool:
    """Whether this process may read its peers and be read (see the module's docstring)."""
    return enabled_from_env(env) and _ptrace_scope() == 0 and _syscall_works()


def _boot_key() -> int:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return int(f.read().strip().replace("-", ""), 16) & ((1 << 63) - 1)
    except (OSError, ValueError):
        return -1


def identity(env=os.environ) -> list[int]:
    """[capable, kernel boot, PID namespace, user, pid]: what a peer needs to decide whether it may read us."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = -1
    return [int(capable(env)), _boot_key(), pidns, os.getuid(), os.getpid()]


def readable(me: list[int], them: list[int]) -> bool:
    """Pure: whether the process of `identity` `me` may read the one of `them`, and be read by it
    (symmetric, so both ends of a pair agree): both capable, one kernel boot, PID namespace and user."""
    return bool(me[0] and them[0]) and me[1] >= 0 and me[2] >= 0 and me[1:4] == them[1:4] and me[4] != them[4]


def describe(t) -> list[int]:
    """Pure: a tensor view as [address, bytes of its contiguous block, k, then k (count, stride in bytes)
    of the dimensions around the block, outermost first]: its bytes in order, as runs a peer can read."""
    size = t.element_size()
    dims = [(n, s * size) for n, s in zip(t.shape, t.stride()) if n != 1]
    block = size
    while dims and dims[-1][1] == block:
        block *= dims.pop()[0]
    if t.numel() == 0:
        block, dims = 0, []
    out = [t.data_ptr(), block, len(dims)]
    for n, stride in dims:
        out += [n, stride]
    return out


def runs(desc: list[int]) -> np.ndarray:
    """Pure: the (address, length) of every run of a described view, in order (uint64, shape (n, 2))."""
    addr, block, k = desc[0], desc[1], desc[2]
    offsets = np.zeros(1, dtype=np.int64)
    for i in range(k):
        count, stride = desc[3 + 2 * i], desc[4 + 2 * i]
        offsets = (offsets[:, None] + np.arange(count, dtype=np.int64) * stride).reshape(-1)
    out = np.empty((len(offsets), 2), dtype=np.uint64)
    out[:, 0] = offsets + addr
    out[:, 1] = block
    return out


def read(pid: int, into, desc: list[int]) -> None:
    """Read the view `desc` (describe) of process `pid` into contiguous tensor `into`, which must hold
    exactly its bytes; OSError that names the cause when the kernel refuses or the sizes differ."""
    got_bytes = into.numel() * into.element_size()
    if desc[2] == 0:  # one block, as most messages are: one call, no table
        if desc[1] != got_bytes:
            raise OSError(f"process {pid} describes {desc[1]} bytes where {got_bytes} are expected")
        if got_bytes:
            _call(_readv, pid, _IOVec(into.data_ptr(), got_bytes), ctypes.byref(_IOVec(desc[0], got_bytes)), 1,
                  got_bytes, "reading", "of")
        return
    table = runs(desc)
    want = int(table[:, 1].sum()) if len(table) else 0
    if want != got_bytes:
        raise OSError(f"process {pid} describes {want} bytes where {got_bytes} are expected")
    base, done = into.data_ptr(), 0
    for lo in range(0, len(table), IOV_MAX):
        part = np.ascontiguousarray(table[lo:lo + IOV_MAX])
        n = int(part[:, 1].sum())
        if n:
            _call(_readv, pid, _IOVec(base + done, n), part.ctypes.data, len(part), n, "reading", "of")
        done += n


def _call(fn, pid: int, local: _IOVec, remote, nremote: int, n: int, doing: str, prep: str) -> None:
    got = fn(pid, ctypes.byref(local), 1, remote, nremote, 0)
    if got != n:
        err = ctypes.get_errno()
        raise OSError(err, f"{doing} {n} bytes {prep} process {pid}: "
                           f"{os.strerror(err) if got < 0 else f'only {got} done'}")


def write(pid: int, src, addr: int) -> None:
    """Write contiguous tensor `src` to address `addr` of process `pid` (a contiguous buffer there that
    holds exactly its bytes); OSError that names the cause when the kernel refuses."""
    n = src.numel() * src.element_size()
    if n:
        _call(_writev, pid, _IOVec(src.data_ptr(), n), ctypes.byref(_IOVec(addr, n)), 1, n, "writing", "into")
