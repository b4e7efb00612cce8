"""The local backend's fork server: a forked worker is what `python ARGV` would be (argv, sys.path,
environment, working directory, output, exit status, threads), and what it cannot run that way starts
as a new process. Real forks of a real server; each check fails when the child is not set up like a
new interpreter."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.backends import forkserver
from launcher.backends.local import LocalNodes

from tests.paths import ROOT

PROBE = """
import json, os, sys
import torch
out = {"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
       "threads": torch.get_num_threads(), "main": __name__, "has_extra": "extra_mod_dir" in sys.path[1],
       "pid": os.getpid()}
print(json.dumps(out))
code = int(os.environ.get("PROBE_EXIT", "0"))
if code == 99:
    raise ValueError("the probe was told to fail")
sys.exit(code)
"""


@pytest.fixture(scope="module")
def server():
    s = forkserver.ForkServer()
    yield s
    s.close()


def _env(**extra) -> dict[str, str]:
    return {**os.environ, **extra}


def _read(log: Path) -> dict:
    return json.loads(log.read_text().splitlines()[0])


def test_a_script_runs_as_python_would_run_it(server, tmp_path):
    script = tmp_path / "sub" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path / "probe.log"
    extra = tmp_path / "extra_mod_dir"
    old = os.getcwd()
    os.chdir(work)
    try:
        p = server.spawn([sys.executable, str(script), "a", "--b"],
                         _env(PROBE_VALUE="x1", PYTHONPATH=str(extra), OMP_NUM_THREADS="1"), str(log))
    finally:
        os.chdir(old)
    assert isinstance(p, forkserver.ForkedProcess)
    assert p.wait(timeout=120) == 0
    got = _read(log)
    assert got["argv"] == [str(script), "a", "--b"]
    assert got["path0"] == str(script.parent)  # the script's folder first, as python puts it
    assert got["has_extra"]  # then $PYTHONPATH
    assert got["cwd"] == str(work) and got["env"] == "x1" and got["main"] == "__main__"
    assert got["threads"] == 1  # OMP_NUM_THREADS applies as it does when torch is imported afresh
    assert got["pid"] == p.pid and p.pid != server._conn.proc.pid


def test_a_module_runs_as_python_m_runs_it(server, tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    log = tmp_path / "m.log"
    p = server.spawn([sys.executable, "-m", "probe_mod", "x"], _env(PYTHONPATH=str(tmp_path), PROBE_EXIT="3"),
                     str(log))
    assert p.wait(timeout=120) == 3  # sys.exit(3) is the exit status
    got = _read(log)
    assert got["argv"] == [str(tmp_path / "probe_mod.py"), "x"] and got["main"] == "__main__"
    assert got["path0"] == os.getcwd()  # python -m puts the working directory first


def test_an_uncaught_exception_is_printed_and_exits_1(server, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    log = tmp_path / "e.log"
    p = server.spawn([sys.executable, str(script)], _env(PROBE_EXIT="99"), str(log))
    assert p.wait(timeout=120) == 1
    text = log.read_text()
    assert "Traceback" in text and "ValueError: the probe was told to fail" in text


def test_a_signalled_worker_reports_the_signal_and_goes_by_its_name(server, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import sys, time\nprint('up', flush=True)\ntime.sleep(600)\n")
    log = tmp_path / "s.log"
    p = server.spawn([sys.executable, str(script)], _env(), str(log), name="elastic-dev7")
    deadline = time.monotonic() + 120
    while "up" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is None
    assert Path(f"/proc/{p.pid}/comm").read_text().strip() == "elastic-dev7"  # what ps -e and pgrep show
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM  # Popen's convention
    p.kill()  # after its end: nothing to signal, no error


def test_a_worker_that_aborts_says_where_in_its_log(server, tmp_path):
    script = tmp_path / "aborts.py"
    script.write_text("import os\n\ndef deep_in_the_script():\n    os.abort()\n\ndeep_in_the_script()\n")
    log = tmp_path / "a.log"
    p = server.spawn([sys.executable, str(script)], _env(), str(log))
    assert p.wait(timeout=120) == -signal.SIGABRT
    text = log.read_text()
    assert "Fatal Python error: Aborted" in text and "in deep_in_the_script" in text, text


def test_what_python_would_not_run_the_same_way_is_not_forked(server, tmp_path):
    script = str(tmp_path / "x.py")
    assert server.spawn([sys.executable, "-u", script], _env(), None) is None  # interpreter flags
    assert server.spawn(["/bin/echo", "hi"], _env(), None) is None  # not this interpreter
    assert server.spawn([sys.executable, script], _env(TORCH_SHOW_CPP_STACKTRACES="1"), None) is None  # read at import
    assert server.spawn([sys.executable, script], _env(PYTHONHASHSEED="7"), None) is None  # read at start
    base = dict(os.environ)
    assert forkserver.forkable([sys.executable, script], {**base, "ELASTIC_FAULT": "1:step:3"}, base)


def test_a_changed_environment_gets_a_new_server_and_the_old_one_reports_its_children(tmp_path, monkeypatch):
    s = forkserver.ForkServer()
    try:
        sleeper = tmp_path / "sleeper.py"
        sleeper.write_text("import time\ntime.sleep(600)\n")
        quick = tmp_path / "quick.py"
        quick.write_text("import sys\nprint(sys.flags.hash_randomization)\n")
        long = s.spawn([sys.executable, str(sleeper)], _env(), None)
        first = s._conn
        monkeypatch.setenv("PYTHONHASHSEED", "0")  # read by a new interpreter at start: the old imports no longer fit
        log = tmp_path / "q.log"
        p = s.spawn([sys.executable, str(quick)], _env(), str(log))
        assert s._conn is not first and first.proc.poll() is None  # the old one waits for its child
        assert p.wait(timeout=120) == 0 and log.read_text() == "0\n"  # PYTHONHASHSEED=0 took effect
        long.kill()
        assert long.wait(timeout=30) == -signal.SIGKILL  # reported by the retired server
        assert first.proc.wait(timeout=30) == 0  # which then ends
    finally:
        s.close()


def test_the_local_backend_forks_its_workers_and_falls_back_to_new_processes(tmp_path):
    nodes = LocalNodes(1, 2, log_dir=tmp_path / "logs")
    script = tmp_path / "w.py"
    script.write_text("import os\nprint('device', os.environ['ELASTIC_DEVICE'], flush=True)\n")
    h = nodes.start("node0", 0, {"ELASTIC_STORE": "127.0.0.1:1"}, ["python", str(script)])
    assert all(isinstance(p, forkserver.ForkedProcess) for p in h.procs.values())
    assert h.wait(120) and h.exited() == {0: 0, 1: 0}
    assert (tmp_path / "logs" / "worker-dev1.log").read_text() == "device 1\n"
    fresh = LocalNodes(1, 2, log_dir=tmp_path / "fresh", fork_server=False)
    h = fresh.start("node0", 0, {"ELASTIC_STORE": "127.0.0.1:1"}, ["python", str(script)])
    assert all(isinstance(p, subprocess.Popen) for p in h.procs.values())
    assert h.wait(120) and h.exited() == {0: 0, 1: 0}
    assert (tmp_path / "fresh" / "worker-dev0.log").read_text() == "device 0\n"


ENDING = """
import atexit, os, sys, threading, time

class AbortsWhenTornDown:  # what a gloo process group still alive at the interpreter's teardown may do
    def __init__(self):
        self.abort = os.abort
    def __del__(self):
        self.abort()

threading.keep_until_teardown = AbortsWhenTornDown()
left_open = open(sys.argv[1] + ".open", "w")
left_open.write("written, never closed")  # buffered: only a flush puts it on disk
atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").write("atexit ran"))

def late():
    time.sleep(0.3)
    open(sys.argv[1] + ".thread", "w").write("thread done")

threading.Thread(target=late).start()  # not a daemon: python waits for it
sys.exit(5)
"""


def test_a_worker_ends_as_python_ends_but_skips_the_teardown_that_can_abort_it(server, tmp_path):
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    base = tmp_path / "out"
    p = server.spawn([sys.executable, str(script), str(base)], _env(), str(tmp_path / "ending.log"))
    assert p.wait(timeout=120) == 5, (tmp_path / "ending.log").read_text()  # not -6: no teardown ran
    assert (tmp_path / "out.thread").read_text() == "thread done"  # its non-daemon thread was waited for
    assert (tmp_path / "out.atexit").read_text() == "atexit ran"
    assert (tmp_path / "out.open").read_text() == "written, never closed"
