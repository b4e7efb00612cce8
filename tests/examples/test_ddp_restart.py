"""examples/ddp_restart.py under `elastic-launch --backend local` in restart mode (torchrun's contract):
real worker processes, a shrink 2 -> 1 and a grow 1 -> 2 requested with `elastic resize`, the script
resuming from its own DCP checkpoint each time. The oracle is the script's own step log: steps go on
from the last checkpoint (at most --ckpt-every - 1 steps redone, none skipped)."""
from __future__ import annotations

from pathlib import Path

from db import Store
from launcher.cli import main as elastic
from tests.examples.harness import ddp_rows as _log, run_local, wait


def test_ddp_script_restarts_on_shrink_and_grow_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/e.db"
    log, pace = tmp_path / "steps.log", tmp_path / "pace"  # the script's --step-sleep applies while pace exists
    pace.touch()

    def drive(alive) -> None:
        wait(lambda: Store(url).find_job("ddp") is not None, 30, "the job to be registered", alive)
        job = Store(url).find_job("ddp")
        assert (job.mode, job.state, job.layout) == ("restart", "running", "pp1tp1dp2")  # listed at once
        wait(lambda: len(_log(log)) >= 3, 120, "3 steps on 2 workers", alive)
        assert elastic(["resize", "ddp", "--nodes", "1", "--db", url]) == 0
        wait(lambda: any(r[3] == 1 for r in _log(log)), 120, "a step after the shrink", alive)
        wait(lambda: _log(log)[-1][0] >= 9, 120, "step 9 on one worker", alive)
        assert elastic(["resize", "ddp", "--nodes", "2", "--db", url]) == 0
        wait(lambda: any(r[3] == 2 for r in _log(log)), 120, "a step after the grow", alive)
        pace.unlink()  # the steps left need not leave a resize time to land

    run_local(tmp_path, ["--gpus-per-node", "1", "--job-name", "ddp", "--term-timeout", "20"],
              ["ddp_restart.py", "--steps", "16", "--ckpt-every", "2", "--ckpt-dir", str(tmp_path / "ckpt"),
               "--log", str(log), "--step-sleep", "0.3", "--sleep-while", str(pace)], drive)
    rows = _log(log)
    assert sorted({(r[3], r[2]) for r in rows}) == [(0, 2), (1, 1), (2, 2)], rows  # worlds: 2, then 1, then 2
    for before, after in zip(rows, rows[1:]):
        if after[3] != before[3]:  # the first step of a new world follows the last checkpoint (every 2 steps)
            # the script logs a step once its checkpoint is published: the newest checkpoint is the last
            # logged even step, or (stopped between publishing and logging it) the step after an odd one
            newest = {before[0] // 2 * 2} | ({before[0] + 1} if before[0] % 2 else set())
            assert after[0] - 1 in newest, (before, after)
        else:
            assert after[0] == before[0] + 1, (before, after)
    assert rows[-1][0] == 16
    store = Store(url)
    job = store.find_job("ddp")
    assert job.state == "finished" and job.mode == "restart"
    assert [m.layout for m in store.rank_maps(job.id)] == ["pp1tp1dp2", "pp1tp1dp1", "pp1tp1dp2"]
    migs = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    assert [(m.kind, m.trigger, m.status, m.from_layout, m.to_layout) for m in migs] == [
        ("restart", "resize", "succeeded", "pp1tp1dp2", "pp1tp1dp1"),
        ("restart", "resize", "succeeded", "pp1tp1dp1", "pp1tp1dp2")]
    for m in migs:
        assert set(m.phases) == {"stop", "start"} and m.pause_s is not None and m.pause_s > 0
    assert [r.status for r in store.list_requests(job.id)] == ["done", "done"]
