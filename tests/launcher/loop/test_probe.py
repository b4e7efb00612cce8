"""The launcher's answer to workers whose collective failed while no worker was seen ending
(launcher.loop.probe), and the workers' side of it (launcher.runtime.faults.is_peer_failure), over a real
control-plane store. The backend is a stand-in: what is tested is our decision, which node is gone (the
real Slurm backend's answer is tested on the testbed: tests/launcher/backends/slurm/test_node_crash.py)."""
from __future__ import annotations

import threading
import time

import pytest

from launcher.loop import probe as probe_module
from launcher.loop.probe import NodeProbe
from launcher.runtime.faults import is_peer_failure
from launcher.wire.control import Control

NODE_OF = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}


class Holdings:
    def node_of(self, d: int) -> str:
        return NODE_OF[d]


class Backend:
    probe_s = 4.0

    def __init__(self, gone=None, said=None) -> None:
        self.gone, self.asked, self.said, self.watched = dict(gone or {}), [], dict(said or {}), []

    def unreachable(self, nodes, steps=True):
        if not steps:  # the cluster's own word, every WATCH_S
            self.watched.append(list(nodes))
            return {n: why for n, why in self.said.items() if n in nodes}
        self.asked.append(list(nodes))
        return {n: why for n, why in self.gone.items() if n in nodes}


@pytest.fixture
def ctl():
    return Control("127.0.0.1", 0, server=True)


class Mode:
    def __init__(self, ctl: Control) -> None:
        self.ctl = ctl


@pytest.fixture(autouse=True)
def quick_settle(monkeypatch):
    monkeypatch.setattr(probe_module, "SETTLE_S", 0.2)


def _poll(p: NodeProbe, world: str, until: float):
    """Poll as the launcher does until something is found gone or `until` s pass."""
    deadline = time.monotonic() + until
    while time.monotonic() < deadline:
        found = p.gone(world, [0, 1, 2, 3])
        if found:
            return found
        time.sleep(0.05)
    return {}


def test_nothing_suspected_nothing_checked_but_the_clusters_word_now_and_then(ctl, monkeypatch) -> None:
    monkeypatch.setattr(probe_module, "WATCH_S", 0.3)
    backend = Backend({"n2": "crashed"})
    assert _poll(NodeProbe(backend, Mode(ctl), Holdings(), print), "w0", 1) == {}
    assert backend.asked == [] and ctl.probe("w0") is None
    assert 2 <= len(backend.watched) <= 5 and backend.watched[0] == ["n1", "n2"]


def test_a_node_the_cluster_calls_down_is_gone_without_any_suspicion(ctl, monkeypatch) -> None:
    monkeypatch.setattr(probe_module, "WATCH_S", 0.3)
    backend = Backend(said={"n1": "Slurm says it is down, not responding"})
    assert _poll(NodeProbe(backend, Mode(ctl), Holdings(), print), "w0", 2) == {"n1": "Slurm says it is down, not responding"}


def test_the_quiet_devices_node_is_asked_about_and_found_gone(ctl) -> None:
    for d in (0, 1):  # n1's workers report; n2's are gone and never will
        ctl.suspect("w3", d, "RuntimeError: Connection closed by peer")
    backend = Backend({"n2": "a one-task step on it failed"})
    found = _poll(NodeProbe(backend, Mode(ctl), Holdings(), print), "w3", 3)
    assert found == {"n2": "a one-task step on it failed"}
    assert backend.asked == [["n2"]]  # only the node whose workers said nothing
    assert ctl.probe("w3") == "4.0"  # the workers were told how long the check may take


def test_every_worker_reporting_is_a_clear_at_once(ctl) -> None:
    for d in range(4):
        ctl.suspect("w1", d, "RuntimeError: the script's own")
    backend = Backend()
    assert _poll(NodeProbe(backend, Mode(ctl), Holdings(), print), "w1", 1) == {}
    assert ctl.probe("w1") == "clear" and backend.asked == []


def test_a_quiet_node_that_answers_is_cleared_after_the_backends_time(ctl) -> None:
    for d in (0, 1):
        ctl.suspect("w2", d, "RuntimeError: x")
    backend = Backend()
    p = NodeProbe(backend, Mode(ctl), Holdings(), print)
    t0 = time.monotonic()
    assert _poll(p, "w2", 2) == {} and ctl.probe("w2") == "4.0"  # still checking
    assert _poll(p, "w2", 4) == {} and ctl.probe("w2") == "clear"
    assert time.monotonic() - t0 >= backend.probe_s
    assert backend.asked[0] == ["n2"] and all(a == [] for a in backend.asked[1:])  # asked once


def _answer_later(ctl: Control, world: str, after: float, *, abort: bool = False, verdict: str | None = None):
    def run():
        time.sleep(after)
        if abort:
            ctl.abort_world(world)
        if verdict is not None:
            ctl.set_probe(world, verdict)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_worker_waits_for_the_launchers_answer(ctl) -> None:
    """A plain RuntimeError with no abort mark: the worker cuts its sockets, posts its suspicion, and takes
    the abort mark as a peer's failure and "clear" as its own error; an announced check extends its wait
    beyond ABORT_WAIT_S."""
    ctl.device = 2
    cut = []
    _answer_later(ctl, "w5", 0.3, abort=True)
    assert is_peer_failure(RuntimeError("Connection closed by peer"), ctl, "w5", lambda: cut.append(1), wait_s=5)
    assert cut == [1] and ctl.suspect_count("w5") == 1 and ctl.suspected("w5", [0, 1, 2, 3]) == [2]

    _answer_later(ctl, "w6", 0.3, verdict="clear")
    assert not is_peer_failure(RuntimeError("shape mismatch"), ctl, "w6", wait_s=5)

    ctl.set_probe("w7", "2")  # the launcher checks the nodes for up to 2 s: waited for beyond wait_s=0.2
    _answer_later(ctl, "w7", 1.0, abort=True)
    t0 = time.monotonic()
    assert is_peer_failure(RuntimeError("Connection closed by peer"), ctl, "w7", wait_s=0.2)
    assert time.monotonic() - t0 >= 0.9

    t0 = time.monotonic()  # no answer at all: the worker's own error, after wait_s
    assert not is_peer_failure(RuntimeError("x"), ctl, "w8", wait_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    assert not is_peer_failure(ValueError("not a collective's"), ctl, "w9", wait_s=5)
