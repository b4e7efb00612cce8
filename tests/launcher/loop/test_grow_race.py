"""A grow that races the end of training: the job reaches its last step while the launcher is starting
the grow's workers. Real worker processes (launcher.runtime, local backend); the race is forced by the
script (tests/launcher/loop/grow_race_script.py), not by timing. The launcher declines the grow: the
migration is recorded `declined` with the reason (not `failed`), the request answered, no `resume`
posted to the workers that have exited, and the job ends `finished` with every step run once."""
from __future__ import annotations

from pathlib import Path

from db import Store
from launcher.backends.local import LocalNodes
from launcher.cli import main as elastic
from launcher.launch import Launcher, Options

SCRIPT = Path(__file__).with_name("grow_race_script.py")
STEPS = 12


def test_a_grow_racing_the_last_step_is_declined_not_failed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/e.db"
    store = Store(url)
    opts = Options(1, 2, 1, [], ["python", str(SCRIPT), str(tmp_path), str(STEPS)], job_name="race", poll=0.05,
                   ready_timeout=120, migrate_timeout=120)
    la = Launcher(opts, LocalNodes(2, 1, log_dir=tmp_path / "logs"), store)
    asked: list[int] = []

    def until(la: Launcher) -> bool:
        if la.restarts is not None or la.db.pending_requests(la.job_id):
            return False  # not live yet, or a request still to be carried out
        if not asked and la.max_step() >= 2:
            asked.append(1)
            assert elastic(["resize", "race", "--nodes", "1", "--db", url]) == 0
        elif asked == [1] and (tmp_path / "last").exists():  # one device, in its last step: grow now
            asked.append(2)
            assert elastic(["resize", "race", "--nodes", "2", "--db", url]) == 0
        return False

    rc = la.run(until=until)
    assert asked == [1, 2], [o.message for o in la.outcomes]
    job = store.find_job("race")
    assert (rc, job.state) == (0, "finished"), [o.message for o in la.outcomes]
    rows = [line.split() for line in (tmp_path / "steps").read_text().splitlines()]
    assert [int(s) for s, _ in rows] == list(range(1, STEPS + 1))  # every step once
    assert rows[-1][1] == "pp1tp1dp1"  # the last step ran on the shrunk layout
    migs = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    assert [(m.status, m.from_layout, m.to_layout) for m in migs] == [
        ("succeeded", "pp1tp1dp2", "pp1tp1dp1"), ("declined", "pp1tp1dp1", "pp1tp1dp2")]
    assert "training ended" in migs[1].error and "declined" in migs[1].error
    reqs = sorted(store.list_requests(job.id), key=lambda r: r.id)
    assert [r.status for r in reqs] == ["done", "failed"] and "training ended" in reqs[1].message
    kinds = [la.ctl.event(e)["kind"] for e in range(la.epoch + 1) if la.ctl.event(e) is not None]
    assert "resume" not in kinds, kinds  # nobody was told to train on: the workers had finished
    assert not la.handles  # the grow's worker was stopped, every worker exited
