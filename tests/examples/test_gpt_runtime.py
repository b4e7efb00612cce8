"""The reference GPT through the public runtime API (tests/examples/gpt_script.py, migrate.gpt_live's builder,
manifest and step) on 2 nodes x 2 devices: tp2dp2, shrunk to one node (tp2dp1) and grown back, live; and with
pipeline stages, pp2dp2 shrunk to tp2 (the second stage's layers move into TP shards) and back, releasing old
tensors early (--release-early). Oracle: the
loss of every step equals the uninterrupted one-process reference trainer's (within 1e-5: TP and DP change
the reduction order), every step once, and every migration recorded bit-exact (the transferred pieces' digests
compared at both ends). Each migration reports what the reference worker's do (phases, the
step it applied at, every worker's marks for launcher.loop.timeline) and keeps the process group whose members do
not change: the shrink's migration world is the old training world, the grow's new training world is its
migration world. In every step of every worker, gloo's I/O threads run at the lowest priority
(launcher.runtime.threads)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from db import Store
from launcher.backends.local import LocalNodes
from launcher.loop.launcher import Launcher
from launcher.options import Options
from launcher.loop.timeline import read as read_timeline
from migrate.layout import ParallelConfig
from tests.launcher.loop.test_faults import check_curve, read_losses

from tests.paths import ROOT
from tests.records import verification_told
#: enough steps after the grow is asked for (at step 10) that new workers starting on a loaded machine
#: join before training ends (18 left a CI run's grow declined: training ended first)
STEPS = 30


@pytest.mark.parametrize("big, small, early", [("pp1tp2dp2", "pp1tp2dp1", False), ("pp2tp1dp2", "pp1tp2dp1", True)])
def test_reference_gpt_migrates_live_through_the_runtime_by_its_own_manifests(tmp_path: Path, big: str,
                                                                              small: str, early: bool) -> None:
    loss_file, pace, gc_file = tmp_path / "loss.txt", tmp_path / "pace", tmp_path / "gc.txt"
    pace.touch()  # steps sleep until both resizes have an outcome, then run at full speed (no padding)
    cmd = ["python", str(ROOT / "tests" / "examples" / "gpt_script.py"), "--steps", str(STEPS), "--loss-file",
           str(loss_file), "--step-sleep", "0.3", "--sleep-while", str(pace),
           "--gc-file", str(gc_file)]
    opts = Options(1, 2, 2, [ParallelConfig.parse(x) for x in (big, small)], cmd, job_name="gpt", poll=0.05,
                   ready_timeout=120, migrate_timeout=120, release_early=early)
    store = Store(f"sqlite:///{tmp_path}/e.db")
    la = Launcher(opts, LocalNodes(2, 2, log_dir=tmp_path / "logs"), store)
    t0, todo = time.monotonic(), [(3, 1), (10, 2)]

    def until(la: Launcher) -> bool:
        assert time.monotonic() - t0 < 300, [o.message for o in la.outcomes]
        if todo and la.live and la.max_step() >= todo[0][0]:
            la.db.add_request(la.job_id, "shrink" if todo[0][1] == 1 else "grow", {"nodes": todo.pop(0)[1]}, "t")
        if not todo and pace.exists() and sum(o.migration_id is not None for o in la.outcomes) >= 2:
            pace.unlink()
        return False

    assert la.run(until=until) == 0, [o.message for o in la.outcomes]
    rows = read_losses(loss_file)
    check_curve(rows, STEPS)
    layouts = [lay for _s, _v, lay in rows]
    assert layouts[0] == big and small in layouts and layouts[-1] == big
    job = store.find_job("gpt")
    migs = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    assert [(m.status, m.from_layout, m.to_layout) for m in migs] == [("succeeded", big, small),
                                                                      ("succeeded", small, big)]
    assert migs[1].bytes_moved > 0
    assert all(verification_told(m) for m in migs) and migs[1].bit_exact is True
    assert all(set(m.phases) == {"plan", "build_groups", "execute", "rebuild", "other"} for m in migs), migs
    shrink, grow = [o for o in la.outcomes if o.migration_id is not None]
    assert 3 <= shrink.at_step < grow.at_step, (shrink.at_step, grow.at_step)
    assert [m.at_step for m in migs] == [shrink.at_step, grow.at_step]
    e_shrink, e_grow = (int(o.worlds[1][1:]) for o in (shrink, grow))
    kept_on = tuple(d for d, m in sorted(shrink.marks.items()) if "built" in m)
    assert kept_on == (0, 1), shrink.marks  # the batch node's devices
    for out, stays, leaves in ((shrink, (0, 1), (2, 3)), (grow, (0, 1, 2, 3), ())):
        e = int(out.worlds[1][1:])
        assert set(out.marks) == set(stays) | set(leaves), out.marks
        for d, marks in out.marks.items():
            want = {"boundary", f"met m{e}", f"formed m{e}", "moved", "agreed"} | (
                {f"formed w{e}", "built"} if d in stays else set())
            assert want <= set(marks), (d, sorted(marks))
            assert marks["boundary"] <= marks["moved"] <= marks["agreed"], (d, marks)
    # kept process groups: the shrink's migration world on all four, the grow's training world on all four
    assert all(f"kept m{e_shrink}" in m for m in shrink.marks.values()), shrink.marks
    assert all(f"kept w{e_grow}" in m for m in grow.marks.values()), grow.marks
    assert not any(f"kept w{e_shrink}" in m or f"kept m{e_grow}" in m for o in (shrink, grow) for m in o.marks.values())
    tl = read_timeline(la.ctl, grow, kept_on, la.current.devices)  # what elastic bench --explain prints
    assert tl is not None and set(tl.rows) == {0, 1, 2, 3}, tl
    assert sum(tl.critical_path().values()) == pytest.approx(tl.pause_s)
    check_collector_held_for_the_first_step_only(gc_file)
    check_gloo_threads_lowered(gc_file)
    timeline = store.steps(job.id)  # job.report_loss: every step's, as the script logged it
    assert [(r.step, r.loss, r.layout) for r in timeline] == rows, (timeline, rows)


def check_collector_held_for_the_first_step_only(gc_file: Path) -> None:
    """launcher.runtime.collector: during a worker's first step after a migration (the pause ends with its commit) the
    objects alive before the pause are out of the garbage collector's reach; from the next step on, and in any
    step not right after a migration, nothing is (no object stays uncollectable)."""
    steps: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for line in gc_file.read_text().splitlines():
        pid, migrations, step, frozen, _threads = line.split()
        steps.setdefault((pid, int(migrations)), []).append((int(step), int(frozen)))
    assert any(m > 0 for _p, m in steps), steps  # workers that took part in a migration wrote
    for (pid, migrations), rows in steps.items():
        rows.sort()
        first, rest = rows[0], rows[1:]
        assert (first[1] > 0) == (migrations > 0), (pid, migrations, rows)
        assert all(frozen == 0 for _s, frozen in rest), (pid, migrations, rows)


def check_gloo_threads_lowered(gc_file: Path) -> None:
    """launcher.runtime.threads: in every step of every worker, the worlds formed at the start, in the migrations
    and for the new layouts included, each gloo I/O thread is at the lowest priority."""
    threads = [line.split()[4] for line in gc_file.read_text().splitlines()]
    assert threads and all(low == every and int(every) > 0 for low, every in (t.split("/") for t in threads)), threads
