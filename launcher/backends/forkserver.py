"""Local workers forked from one process that has imported torch already, instead of each importing it.

Why: every worker is a Python process that imports torch (and, at its first optimizer step, torch's
compiler stack) before it does anything; on this kind of machine that is about 5 s of CPU per worker,
and the local backend runs every simulated device on the same few cores, so starting 8 workers took
40 s of CPU and a grow's new workers took it from the ones still training. The fork server imports
those once; each worker is then a fork of it that runs the worker's command line as `python` would
(`-m module` or a script path, its arguments, environment, working directory and log file), in a
process of its own with its own pid, signals and exit status. It ends as `python` ends (threads
waited for, atexit functions run, files flushed) but skips the interpreter's teardown (`end`).

Only what `python` itself would do the same way is forked: the launcher's interpreter, no interpreter
flags, and an environment that differs from the server's only where the fork can apply it as a new
interpreter would (PYTHONPATH, PYTHONUNBUFFERED, OMP_NUM_THREADS, and variables torch and Python do
not read while importing). Anything else is started as a new process as before (`forkable`).

The launcher side (`ForkServer`, `ForkedProcess`) and the server (`python -m launcher.backends.forkserver
REQ_FD REP_FD`) speak JSON lines over two pipes: a request {id, argv, env, cwd, log} is answered with
{id, pid}, and every child that ends with {pid, code} (Popen's returncode: -N for signal N).
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import NoReturn

#: what the server imports before it forks: what every worker imports first, and the most costly
PRELOAD = ("torch", "torch.distributed", "torch.nn.functional", "torch.optim", "torch._dynamo")
#: variables a new interpreter reads while it starts or imports torch: a request whose value differs
#: from the server's is started as a new process (the fork cannot apply it), but for those in APPLIED
READ_AT_START = ("PYTHON", "TORCH", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_", "CUDA",
                 "NVIDIA_", "PYTORCH_")
APPLIED = ("PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS",
           "TORCHINDUCTOR_CACHE_DIR")  # torch sets this one in its own process when it first needs it
SPAWN_WAIT_S = 600.0  # the first request waits for the imports (seconds of CPU, longer on a busy machine)


def forkable(argv: Sequence[str], env: Mapping[str, str], server_env: Mapping[str, str]) -> bool:
    """Whether `argv` run with `env` is what the fork server would run: this interpreter with `-m
    module` or a script path (no interpreter flags), and no difference in what a new interpreter reads
    while it starts that the fork cannot apply."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-m":
        if len(argv) < 3 or argv[2].startswith("-"):
            return False
    elif argv[1].startswith("-"):
        return False
    for key in set(env) | set(server_env):
        if key.startswith(READ_AT_START) and key not in APPLIED and env.get(key) != server_env.get(key):
            return False
    return True


class ForkedProcess:
    """A worker forked by the server, with the part of subprocess.Popen's interface the launcher uses."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Connection:
    """One running server: its requests pipe, and the thread that reads its answers and its children's ends."""

    def __init__(self) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        self.env = dict(os.environ)  # what the server's imports saw
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher.backends.forkserver", str(req_r), str(rep_w)],
                                     pass_fds=(req_r, rep_w))
        os.close(req_r)
        os.close(rep_w)
        self.req: int | None = req_w
        self.answers: dict[int, int] = {}
        self.children: dict[int, ForkedProcess] = {}
        self.early: dict[int, int] = {}  # pid -> code of a child that ended before its answer was read
        self.gone = False
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(rep_r,), name="forkserver-reader", daemon=True).start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as rep:
            for line in rep:
                msg = json.loads(line)
                with self.cond:
                    if "id" in msg:
                        self.answers[msg["id"]] = msg["pid"]
                        self.cond.notify_all()
                    elif msg["pid"] in self.children:
                        self.children.pop(msg["pid"])._end(msg["code"])
                    else:
                        self.early[msg["pid"]] = msg["code"]
        with self.cond:  # the server is gone: nobody reports its children's ends any more
            self.gone = True
            self.cond.notify_all()
            for pid in [p for p in self.children if not _alive(p)]:
                self.children.pop(pid)._end(1)

    def alive(self) -> bool:
        return self.req is not None and self.proc.poll() is None

    def spawn(self, rid: int, request: dict) -> ForkedProcess | None:
        try:
            os.write(self.req, json.dumps({"id": rid, **request}).encode() + b"\n")
        except OSError:
            return None
        with self.cond:
            if not self.cond.wait_for(lambda: rid in self.answers or self.gone, SPAWN_WAIT_S) or \
                    rid not in self.answers:
                return None
            pid = self.answers.pop(rid)
            child = ForkedProcess(pid, list(request["argv"]))
            if pid in self.early:
                child._end(self.early.pop(pid))
            else:
                self.children[pid] = child
            return child

    def retire(self) -> None:
        """No more requests: the server ends once its running children have (their ends are still read)."""
        if self.req is not None:
            os.close(self.req)
            self.req = None


class ForkServer:
    """The launcher's end: starts a server on first use, forks workers through it. A server imported
    torch with the environment of its start: when what a new interpreter would read at start changed
    since (e.g. a test's PYTHONHASHSEED), a new server is started for the new environment and the old one
    retires once its children have ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._conn: _Connection | None = None
        self._retired: list[_Connection] = []

    def spawn(self, argv: list[str], env: Mapping[str, str], log: str | None, name: str = "") -> ForkedProcess | None:
        """Fork `argv` (forkable) with `env`, output appended to `log` (None: the launcher's own
        stdout and stderr), named `name` in ps and top (its command line there is the server's); None
        when it cannot be forked (start it as a new process instead)."""
        with self._lock:
            if not forkable(argv, env, os.environ):
                return None
            conn = self._conn
            if conn is None or not conn.alive() or not forkable(argv, env, conn.env):
                if conn is not None:
                    conn.retire()
                    self._retired.append(conn)
                conn = self._conn = _Connection()
            self._next += 1
            return conn.spawn(self._next, {"argv": list(argv), "env": dict(env), "cwd": os.getcwd(), "log": log,
                                           "name": name})

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking requests; wait up to `timeout` s for the servers to end (each ends when its last
        child has, or at once without children), then kill them (their running children go on)."""
        with self._lock:
            conns = [c for c in [self._conn, *self._retired] if c is not None]
            self._conn, self._retired = None, []
        for conn in conns:
            conn.retire()
            try:
                conn.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                conn.proc.kill()
                conn.proc.wait()


_SHARED: ForkServer | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> ForkServer:
    """This process's fork server (every local backend of a process forks from one: its imports are paid
    once per process); it ends with the process."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            import atexit

            _SHARED = ForkServer()
            atexit.register(_SHARED.close)
        return _SHARED


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the server ---------------------------------------------------------------------------------
def _reply(fd: int, msg: dict) -> None:
    try:
        os.write(fd, json.dumps(msg).encode() + b"\n")
    except OSError:  # the launcher is gone
        pass


def _reap(fd: int, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            children.discard(pid)
            continue
        if done:
            children.discard(pid)
            _reply(fd, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(req_fd: int, rep_fd: int) -> dict | None:
    """Import PRELOAD, then fork a child per request until the launcher closes the pipe, and report
    every child's end until the last has ended. Returns the request in the child (which then becomes
    the worker), None in the server when it is done."""
    import importlib
    import select

    for name in PRELOAD:
        importlib.import_module(name)
    children: set[int] = set()
    buf, open_ = b"", True
    while open_ or children:
        _reap(rep_fd, children)
        ready, _, _ = select.select([req_fd] if open_ else [], [], [], 0.05)
        if not ready:
            continue
        data = os.read(req_fd, 1 << 20)
        if not data:  # no more requests: report the running children's ends, then stop
            open_ = False
            continue
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os.close(req_fd)
                os.close(rep_fd)
                return req
            children.add(pid)
            _reply(rep_fd, {"id": req["id"], "pid": pid})
    return None


def become(req: dict, before: Mapping[str, str]) -> int:
    """In the forked child: be `python ARGV` as a new interpreter would be, run it, return its exit status.
    `before`: the environment the server started with (what its imports saw)."""
    import runpy

    if req.get("name"):
        _set_name(req["name"])
    if req["log"] is not None:
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.chdir(req["cwd"])
    env = req["env"]
    old_path = [p for p in (before.get("PYTHONPATH") or "").split(os.pathsep) if p]
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS") != before.get("OMP_NUM_THREADS") and env.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1 if unbuffered else -1, closefd=False,  # noqa: SIM115
                                       encoding=sys.stdout.encoding, errors=sys.stdout.errors)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, encoding=sys.stderr.encoding,  # noqa: SIM115
                                       errors="backslashreplace")
    # a worker that aborts or crashes in C code (a gloo thread, a destructor) says where in its log: the
    # Python stack of every thread, as `python -X faulthandler` would; on unless the user's own
    # PYTHONFAULTHANDLER is empty, the rule torchrun_exec gives the workers it starts
    if env.get("PYTHONFAULTHANDLER", "1"):
        faulthandler.enable(sys.stderr, all_threads=True)
    argv = req["argv"]
    module = argv[2] if argv[1] == "-m" else None
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[1]))
    rest = [p for p in sys.path[1:] if p not in old_path]
    sys.path[:] = [first] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + rest
    sys.argv = [argv[1] if module is None else argv[2], *argv[(3 if module else 2):]]
    try:
        if module:
            sys.argv[0] = "-m"  # runpy puts the module's path here, as python -m does
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # python reports it, then ends by SIGINT
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 -- what python prints for an uncaught exception
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _set_name(name: str) -> None:
    """The process's name (/proc/PID/comm: what ps -e, top and pgrep show), at most 15 bytes."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the server's name stays
        pass


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    start_env = dict(os.environ)
    req = serve(int(args[0]), int(args[1]))
    if req is None:
        return
    end(become(req, start_env))


def end(code: int) -> NoReturn:
    """End a forked worker as `python` ends, less the interpreter's teardown: wait for its non-daemon
    threads, run its atexit functions, flush every file it left open, exit with `code`.

    Why: in the teardown every object still alive is destroyed, torch.distributed's process groups
    among them (a model, a pipeline stage or a mesh keeps them past destroy_process_group); a gloo
    thread that needs the interpreter then can be ended by it inside a destructor, which aborts the
    process. Seen in CI: 'terminate called without an active exception', exit -6, in a live-mode worker
    after its last step and checkpoint (earlier in examples/ddp_restart.py, 844614b). The way found: a gloo
    group whose last reference a daemon thread drops while the interpreter finalizes (a fresh interpreter
    doing that aborted in 39 of 40 runs): the groups of worlds the runtime left (Worlds.settle_retired waits
    for their teardown at exit) and the safety checkpoint's write thread, which held the writes' group
    (Safety.settle now waits for the thread to end). The launcher rightly takes an abort
    for a failure, so a job that finished was reported failed. The teardown also costs ~0.6 s of CPU
    per worker, on cores other workers share."""
    import atexit
    import gc
    import io

    try:
        main_thread = threading.main_thread()
        for t in threading.enumerate():
            if t is not main_thread and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
        # what the teardown would flush as it frees them, sys.stdout and sys.stderr among them; type(),
        # not isinstance(): a lazy object's __class__ may warn or raise
        files = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)
        for obj in gc.get_objects():
            if issubclass(type(obj), files):
                try:
                    if not obj.closed:
                        obj.flush()
                except Exception:  # noqa: BLE001 -- a broken pipe, a detached wrapper: as the teardown, go on
                    pass
    finally:
        os._exit(code)


if __name__ == "__main__":
    main()
