"""torchrun's contract in restart mode, through the real `elastic-launch` (local backend, 2 nodes x 2
devices, real processes): every variable torchrun's agent sets, an env:// world that all-reduces and
knows it was launched by torchelastic, TORCHELASTIC_MAX_RESTARTS = --max-restarts, and a rank that fails
inside @record named as torchrun names the root cause (rank, node, exception, traceback) in the
launcher's output, in the restarts' history and in why the job failed."""
from __future__ import annotations

import json
from pathlib import Path

from db import Store
from launcher.loop.rank_errors import first_failure
from tests.launcher.loop.test_restart_mode import launch

SCRIPT = str(Path(__file__).with_name("torchelastic_script.py"))


def test_torchruns_variables_and_an_env_world(tmp_path: Path) -> None:
    out = tmp_path / "seen"
    out.mkdir()
    r = launch(tmp_path, "--nnodes", "2", "--gpus-per-node", "2", "--max-restarts", "2", "--job-name", "tr",
               "--", "python", SCRIPT, "check", str(out))
    assert r.returncode == 0, r.stderr
    seen = {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(seen) == [0, 1, 2, 3]
    assert {s["sum"] for s in seen.values()} == {0.0 + 1 + 2 + 3} and {s["world"] for s in seen.values()} == {4}
    assert all(s["launched"] for s in seen.values())
    assert {s["TORCHELASTIC_MAX_RESTARTS"] for s in seen.values()} == {"2"}
    assert {(s["ROLE_NAME"], s["ROLE_WORLD_SIZE"], s["GROUP_WORLD_SIZE"]) for s in seen.values()} == {("default", "4", "2")}
    files = {s["TORCHELASTIC_ERROR_FILE"] for s in seen.values()}
    assert len(files) == 4 and all(f.endswith(f"/rank-{r}/error.json") for r, f in
                                   ((int(k), s["TORCHELASTIC_ERROR_FILE"]) for k, s in seen.items()))


def test_a_failing_rank_is_named_with_its_node_exception_and_traceback(tmp_path: Path) -> None:
    r = launch(tmp_path, "--nnodes", "2", "--gpus-per-node", "2", "--max-restarts", "1", "--job-name", "bad",
               "--", "python", SCRIPT, "fail")
    assert r.returncode == 1
    cause = "first failure: rank 1 on node0: ValueError: rank 1 is broken on purpose"
    assert cause in r.stderr, r.stderr[-3000:]
    assert "Traceback (most recent call last)" in r.stderr and 'raise ValueError("rank 1 is broken on purpose")' \
        in r.stderr
    store = Store(f"sqlite:///{tmp_path}/e.db")
    job = store.find_job("bad")
    assert job.state == "failed" and cause in store.why_failed(job.id)
    (restart,) = store.history(job=job.id)
    assert restart["trigger"] == "failure" and cause in restart["notes"]


def test_a_failure_without_record_is_named_from_the_workers_output(tmp_path: Path) -> None:
    """No @record, so no error file: the traceback Python printed to the failed worker's log (--log-dir) is
    in the launcher's own output and in why the job failed, as torchrun shows its workers' stderr."""
    r = launch(tmp_path, "--nnodes", "1", "--gpus-per-node", "2", "--max-restarts", "0", "--job-name", "bare",
               "--", "python", SCRIPT, "fail-bare")
    assert r.returncode == 1
    cause = "first failure: rank 1 on node0: ValueError: rank 1 is broken on purpose"
    assert cause in r.stderr, r.stderr[-3000:]
    tb = r.stderr[r.stderr.index(cause):]
    assert "Traceback (most recent call last)" in tb and 'raise ValueError("rank 1 is broken on purpose")' in tb
    store = Store(f"sqlite:///{tmp_path}/e.db")
    assert cause in store.why_failed(store.find_job("bare").id)


def test_the_first_failure_is_the_earliest_one_written(tmp_path: Path) -> None:
    """Two ranks failed: the one whose @record wrote first is the root cause, as torchrun's summary says."""
    for rank, ts, text in ((2, 20, "RuntimeError: peer closed"), (3, 10, "KeyError: 'x'")):
        f = tmp_path / f"rank-{rank}" / "error.json"
        f.parent.mkdir()
        f.write_text(json.dumps({"message": {"message": text, "extraInfo": {"py_callstack": "tb", "timestamp": str(ts)}}}))
    (tmp_path / "rank-1").mkdir()  # a rank that failed without writing (a signal): not a cause
    found = first_failure(tmp_path)
    assert (found.rank, found.message, found.traceback) == (3, "KeyError: 'x'", "tb")
    assert first_failure(tmp_path / "none") is None
