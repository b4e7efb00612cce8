"""Checkpoint folders (launcher.wire.control): a restore reads only a published `step-<S>` with its metadata;
publishing keeps the one complete checkpoint before it when asked (a background safety checkpoint),
and clears older, temporary and half-deleted folders. The expected listings are written out by hand."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from launcher.wire.folders import finalize_checkpoint, latest_checkpoint


def _folder(root: Path, name: str, complete: bool = True) -> None:
    (root / name).mkdir()
    (root / name / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (root / name / ".metadata").write_bytes(b"m")


def test_only_published_folders_with_metadata_are_restored(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None and latest_checkpoint(tmp_path / "missing") is None
    _folder(tmp_path, "step-4")
    _folder(tmp_path, ".tmp-step-8")  # written completely but never published
    _folder(tmp_path, "step-6", complete=False)  # no metadata: not a checkpoint
    _folder(tmp_path, "step-x")
    assert latest_checkpoint(tmp_path) == (str(tmp_path / "step-4"), 4)
    assert latest_checkpoint(tmp_path, before=4) is None


def test_publishing_drops_older_ones_or_keeps_the_previous(tmp_path: Path) -> None:
    _folder(tmp_path, "step-2")
    _folder(tmp_path, "step-4")
    _folder(tmp_path, ".tmp-step-5", complete=False)  # a write that failed
    _folder(tmp_path, ".old-step-1")  # a deletion that was cut short
    _folder(tmp_path, ".tmp-step-6")
    assert finalize_checkpoint(tmp_path, 6, keep_previous=True) == str(tmp_path / "step-6")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6"]
    _folder(tmp_path, ".tmp-step-9")  # a newer write in flight is left alone
    _folder(tmp_path, ".tmp-step-8")
    finalize_checkpoint(tmp_path, 8, keep_previous=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step-9", "step-6", "step-8"]
    assert latest_checkpoint(tmp_path) == (str(tmp_path / "step-8"), 8)
    _folder(tmp_path, ".tmp-step-10")
    finalize_checkpoint(tmp_path, 10)  # a suspend: only the one just written stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10"]


def test_publishing_a_step_again_replaces_it(tmp_path: Path) -> None:
    _folder(tmp_path, "step-4")
    (tmp_path / "step-4" / "stale").write_bytes(b"old")
    _folder(tmp_path, ".tmp-step-4")
    finalize_checkpoint(tmp_path, 4, keep_previous=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]
    assert sorted(p.name for p in (tmp_path / "step-4").iterdir()) == [".metadata", "__0_0.distcp"]


def test_a_background_write_that_dcp_failed_is_dropped_not_raised(tmp_path: Path) -> None:
    # DCP reports a save that lost a peer with CheckpointException, a BaseException: settling it must drop
    # that checkpoint and let training recover, not end the script (seen in CI: every survivor died)
    from concurrent.futures import Future

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from launcher.runtime.ckpt import Safety

    _folder(tmp_path, "step-4")
    logged: list[str] = []
    safety = Safety(str(tmp_path), logged.append)
    fut: Future = Future()
    fut.set_exception(CheckpointException("reduce_scatter failed", {2: _wrap_exception(RuntimeError("Connection closed by peer"))}))
    done = threading.Thread(target=lambda: None)
    done.start()
    safety.pending = (fut, 6, True, done)
    assert safety.settle() is None and safety.pending is None
    assert any("step 6 dropped: CheckpointException" in line for line in logged), logged
    assert latest_checkpoint(tmp_path) == (str(tmp_path / "step-4"), 4)


def test_settling_a_write_waits_for_its_thread_to_end_not_only_for_its_result(tmp_path: Path) -> None:
    # the write's thread sets its result, then still drops its references (the staged copies, the writes'
    # gloo group): settle returns once it ended, so no checkpoint thread is left to the interpreter's teardown
    from concurrent.futures import Future

    from launcher.runtime.ckpt import Safety

    safety, fut, ended = Safety(str(tmp_path), lambda line: None), Future(), threading.Event()

    def write() -> None:
        fut.set_result(None)
        time.sleep(0.5)  # what is left after the result: the thread's frame and its references going away
        ended.set()

    writing = threading.Thread(target=write, daemon=True)
    writing.start()
    safety.pending = (fut, 6, False, writing)
    safety.settle()
    assert ended.is_set() and not writing.is_alive()
