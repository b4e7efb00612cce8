"""Step commits on a real control-plane store: the committing vote stamps the wall time the
launcher measures a migration's pause with."""
from __future__ import annotations

import time

from launcher.wire.control import Control


def test_commit_stamps_first_and_last_commit_times() -> None:
    server = Control("127.0.0.1", 0, server=True)
    rank0 = Control("127.0.0.1", server.port)
    assert server.commit_times("w0") == (None, None)
    before = time.time()
    rank0.stamp_commit("w0", first=True)
    rank0.stamp_commit("w0", first=True)  # a second "first" does not move it
    first, last = server.commit_times("w0")
    assert first is not None and before <= first <= last <= time.time()
    time.sleep(0.01)
    rank0.stamp_commit("w0")
    first2, last2 = server.commit_times("w0")
    assert first2 == first and last2 > first  # the first commit stays, the last moves on
    assert server.commit_times("w1") == (None, None)  # worlds are stamped separately


def test_a_step_settles_once_for_everyone() -> None:
    """launcher.runtime.vote: rank 0's "go" and a failing rank's "no" race on one compare-and-set; the
    first stands for both, and the key can be dropped once everyone is past it."""
    server = Control("127.0.0.1", 0, server=True)
    rank0, failing = Control("127.0.0.1", server.port), Control("127.0.0.1", server.port)
    assert failing.settle_step("w2", 0, "no") is False
    assert rank0.settle_step("w2", 0, "go") is False  # too late: nobody applies step 1
    assert rank0.settle_step("w2", 1, "go") is True
    assert failing.settle_step("w2", 1, "no") is True  # rank 0 was first: the failing rank applies it too
    rank0.drop_step_vote("w2", 0)
    assert rank0.settle_step("w2", 0, "go") is True  # gone: a new decision


def _result(server: Control, epoch: int, device: int) -> dict:
    """The result once the store has it: a TCPStore `set` is not acknowledged, so another connection
    may read before it lands (seen in about 1 of 5 immediate reads on this machine)."""
    deadline = time.monotonic() + 10
    while not server.results(epoch, [device]) and time.monotonic() < deadline:
        time.sleep(0.001)
    return server.results(epoch, [device])[device]


def test_marks_travel_with_results_and_the_first_commit_of_a_world_is_stamped_per_device() -> None:
    server = Control("127.0.0.1", 0, server=True)
    worker = Control("127.0.0.1", server.port)
    worker.device = 3
    worker.mark("boundary", 12.5)
    for _ in range(2):  # what launcher.runtime.job does at each commit
        worker.mark("voted")
        worker.mark("committed")
        worker.stamp_first_step("w4")
        worker.stamp_commit("w4", first=True)
    worker.set_result(4, 3, {"ok": True})  # after the marks' set: the same connection keeps the order
    got = _result(server, 4, 3)
    assert got["ok"] is True and got["marks"]["boundary"] == 12.5 and "voted" in got["marks"]
    first = server.first_step_marks("w4", [3, 5])
    assert list(first) == [3] and first[3]["voted"] <= first[3]["committed"] <= server.commit_times("w4")[1]
    worker.set_result(5, 3, {"ok": True})  # sent marks are cleared; the last step's vote and commit stay
    assert set(_result(server, 5, 3)["marks"]) == {"voted", "committed"}


def test_a_timed_out_migration_says_where_every_worker_stood() -> None:
    """`elastic-launch`'s message for a migration without results: the boundary the workers agreed on
    and each one's finished steps, so a worker that trained past the boundary (or one stuck before it)
    shows in the log."""
    server = Control("127.0.0.1", 0, server=True)  # one connection: its writes land in order
    assert server.where_workers_are(1, [0, 1]) == \
        "agreed boundary: none yet; finished steps: device 0 -, device 1 -"
    for device, step in ((0, 5), (1, 6), (2, 5)):
        server.set_step(device, step)
    assert server.agree_at(1, 3) == 5  # the first proposal: 3 finished steps + 2
    assert server.agree_at(1, 4) == 5  # a later one gets the agreed boundary
    assert server.where_workers_are(1, [0, 1, 2, 3]) == \
        "agreed boundary: after step 5; finished steps: device 0 5, device 1 6, device 2 5, device 3 -"


def _bare(results: dict[int, dict]) -> dict[int, dict]:
    return {d: {k: v for k, v in r.items() if k != "marks"} for d, r in results.items()}


def test_polls_read_every_device_whether_all_some_or_none_have_reported() -> None:
    server = Control("127.0.0.1", 0, server=True)
    worker = Control("127.0.0.1", server.port)
    devices = list(range(8))
    assert server.steps(devices) == {} and server.results(3, devices) == {} and not server.reported(3, devices)
    for d in devices[::2]:
        worker.set_step(d, 10 + d)
        worker.set_result(3, d, {"ok": True, "device": d})
    assert server.steps(devices) == {d: 10 + d for d in devices[::2]}
    assert _bare(server.results(3, devices)) == {d: {"ok": True, "device": d} for d in devices[::2]}
    assert not server.reported(3, devices) and server.reported(3, devices[::2])
    for d in devices[1::2]:
        worker.set_step(d, 20 + d)
        worker.set_result(3, d, {"ok": False, "device": d})
    assert server.steps(devices) == {d: (10 if d % 2 == 0 else 20) + d for d in devices}
    assert _bare(server.results(3, reversed(devices))) == {d: {"ok": d % 2 == 0, "device": d} for d in devices}
    assert server.reported(3, devices) and server.results(4, devices) == {}


def _listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at `port`, from the kernel's own tables."""
    out = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                out.add(addr if width == 8 else "v6:" + addr)
    return out


def test_the_store_listens_only_on_the_address_the_workers_are_told():
    """A stranger on another interface cannot even connect (issue: the store listened on `*:PORT`)."""
    server = Control("127.0.0.1", 0, server=True)
    assert _listening(server.port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 or [::]
    worker = Control("127.0.0.1", server.port)
    worker.set_json("loss", {"step": 1})
    assert _result_of(server, "loss") == {"step": 1}
    port = server.port
    del server, worker
    assert _listening(port) == set()  # the socket went with the store


def _result_of(ctl: Control, key: str):
    deadline = time.monotonic() + 10
    while not ctl.has(key) and time.monotonic() < deadline:
        time.sleep(0.001)
    return ctl.get_json(key)


def test_an_address_that_is_not_this_hosts_is_refused_with_what_to_do():
    import pytest

    with pytest.raises(RuntimeError, match="cannot listen on 192.0.2.1:0 .*--master-addr"):
        Control("192.0.2.1", 0, server=True)


def test_every_reported_loss_is_taken_once_while_reports_keep_coming():
    """The launcher takes what rank 0 appended and clears it with a compare-and-set; a report that lands in
    between is neither lost nor taken twice (before, the launcher copied only the latest report per poll)."""
    import threading
    import time

    server = Control("127.0.0.1", 0, server=True)
    rank0 = Control("127.0.0.1", server.port)
    reports = [(s, 1.0 / s, "pp1tp2dp2") for s in range(1, 2001)]

    def report() -> None:
        for step, loss, layout in reports:
            rank0.report_loss(step, loss, layout)
            if step % 100 == 0:
                time.sleep(0.005)  # the taker's polls fall between reports
        rank0.set_json("done", True)

    writer = threading.Thread(target=report)
    writer.start()
    taken, seen = [], 0
    while True:
        done = server.has("done")
        new, seen = server.take_losses(seen)
        taken += new
        if done and not new:
            break
    writer.join()
    assert taken == reports


def test_a_report_that_lands_between_the_read_and_the_clear_is_taken_at_the_next_poll():
    server = Control("127.0.0.1", 0, server=True)
    rank0 = Control("127.0.0.1", server.port)
    rank0.report_loss(1, 0.5, "pp1")
    rank0.report_loss(2, 0.4, "pp1")
    store = server.store

    class LateReport:  # rank 0 reports step 3 just before the launcher's compare-and-set
        def __getattr__(self, name):
            return getattr(store, name)

        def compare_set(self, key, expected, desired):
            rank0.report_loss(3, 0.3, "pp1")
            rank0.has("losses")  # a round trip on rank 0's connection: its append has landed
            return store.compare_set(key, expected, desired)

    server.store = LateReport()
    new, seen = server.take_losses(0)
    assert new == [(1, 0.5, "pp1"), (2, 0.4, "pp1")] and seen == 2  # not cleared: step 3 came in between
    server.store = store
    assert server.take_losses(seen) == ([(3, 0.3, "pp1")], 0)  # cleared now
    assert server.take_losses(0) == ([], 0)
