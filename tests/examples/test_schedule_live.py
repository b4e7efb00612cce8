"""A learning-rate schedule across migrations (tests/examples/schedule_script.py under `elastic-launch
--backend local`, live mode): the job is shrunk from tp2dp2 to tp2dp1 and grown back while its LR follows
a SequentialLR declared to `runtime.join(scheduler=...)`. Oracle: the same script run without a resize.
The lr of every step is the uninterrupted run's bit for bit (the schedule's arithmetic is the same on every
layout); so is the loss up to the first migration, and after it within float noise (a dp1 layout sums the
gradient in another order). Before the runtime carried the optimizer's settings the lr after the first
migration was the optimizer factory's (1e-2) instead of the schedule's. A restore from a safety checkpoint
(`elastic-launch --resume`) goes on with the schedule too: the checkpoint holds the optimizer's settings and
the scheduler (launcher.runtime.ckpt's run.runtime); the oracle is the schedule stepped alone in this process."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from db import Store
from launcher.cli import main as elastic
from tests.examples import schedule_script
from tests.examples.harness import mixer_rows, run_local, shrink, shrink_and_grow

SCRIPT = "../tests/examples/schedule_script.py"  # run_local runs examples/<script>
STEPS = 60


def _lrs(path: Path) -> dict[int, float]:
    return {int(s): float(lr) for s, lr in (line.split() for line in path.read_text().splitlines())}


def test_the_lr_schedule_and_the_loss_curve_survive_a_shrink_and_a_grow(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    run_local(ref, ["--gpus-per-node", "2", "--layouts", "tp2dp2,tp2dp1", "--job-name", "ref"],
              [SCRIPT, "--steps", str(STEPS), "--log", str(ref / "steps.log"), "--lr-log", str(ref / "lr.log")],
              lambda alive: None)
    want_rows, want_lr = mixer_rows(ref / "steps.log"), _lrs(ref / "lr.log")
    assert [r[0] for r in want_rows] == list(range(1, STEPS + 1)) and {r[1] for r in want_rows} == {"pp1tp2dp2"}
    rows = shrink_and_grow(tmp_path, "sched", "tp2dp2,tp2dp1", "pp1tp2dp1", SCRIPT,
                           ["--steps", str(STEPS), "--lr-log", str(tmp_path / "lr.log"), "--step-sleep", "0.5"])
    got_lr = _lrs(tmp_path / "lr.log")
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)), rows  # every step once
    layouts = [r[1] for r in rows]
    moved = [s for s in range(1, STEPS) if layouts[s] != layouts[s - 1]]
    assert len(moved) == 2, layouts
    assert got_lr == want_lr, (layouts, got_lr, want_lr)  # the schedule's lr at every step, across both migrations
    first = moved[0]  # rows[first] is the first step on the shrunk layout
    assert [r[3] for r in rows[:first]] == [r[3] for r in want_rows[:first]]  # bit-equal before any migration
    assert [r[3] for r in rows] == pytest.approx([r[3] for r in want_rows], rel=1e-4)


def test_a_restore_from_a_safety_checkpoint_goes_on_with_the_schedule(tmp_path: Path) -> None:
    # tp2 on one node, a checkpoint every 4 steps (the last of 10 is step 8's); then --resume on one device
    # runs steps 9..16: their lr is the schedule's, as the optimizer's settings and the scheduler came back
    # from the checkpoint (before, the resumed run started the schedule again: lr 1e-3 at step 9)
    lr_log, said = tmp_path / "lr.log", []
    for launch, steps in ((["--layouts", "tp2", "--checkpoint-every", "4"], 10),
                          (["--resume", "--gpus-per-node", "1", "--layouts", "pp1", "--checkpoint-every", "0"], 16)):
        said.append(run_local(tmp_path, ["--gpus-per-node", "2", "--nnodes", "1", "--job-name", "ck",
                                         "--checkpoint-dir", str(tmp_path / "ck"), *launch],
                              [SCRIPT, "--steps", str(steps), "--log", str(tmp_path / "steps.log"), "--lr-log",
                               str(lr_log)], lambda alive: None))
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=schedule_script.LR)  # the schedule, alone
    sched, want = schedule_script.schedule(opt), []
    for _ in range(16):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    lines = [line.split() for line in lr_log.read_text().splitlines()]
    expected = []
    for out, first, last in zip(said, (1, 9), (10, 16)):
        expected += range(first, last + 1)
        # a worker that dies once its steps are done (the rare abort after the last step, forkserver.end's
        # docstring; one cause, the checkpoint's write thread, is gone) is recovered as any death is: a
        # restore from the checkpoint replays the steps after it
        if restored := re.search(r"workers \[\d+\] died.*\n(?:.*\n)*?.*restored from checkpoint at step (\d+)", out):
            crashes = [log.read_text()[-4000:] for log in sorted((tmp_path / "logs").rglob("*"))
                       if log.is_file() and "Fatal Python error" in log.read_text()]
            warnings.warn(f"a worker died after the run's steps and the job replayed them: {restored.group(0)}\n"
                          + "\n".join(crashes))
            expected += range(int(restored.group(1)) + 1, last + 1)
    assert [int(s) for s, _lr in lines] == expected, (lines, *said)
    assert [float(lr) for _s, lr in lines] == [want[int(s) - 1] for s, _lr in lines]


def test_a_scheduler_made_on_job_optimizer_stops_the_job_at_the_grow_instead_of_diverging(tmp_path: Path) -> None:
    """The script makes its scheduler on job.optimizer instead of declaring it to join (--undeclared): the
    workers that join at the grow start the schedule from the beginning while the others go on with it.
    The step's vote compares every rank's optimizer settings, so the job stops with one line naming the
    cause and the fix instead of training its replicas with different learning rates. The step sleep lasts
    the whole run: were nothing found, the job would run to its end and finish (the test then fails)."""
    pace = tmp_path / "pace"
    pace.touch()

    def drive(alive) -> None:
        shrink(tmp_path, "apart", "pp1tp2dp1", alive)
        assert elastic(["resize", "apart", "--nodes", "2", "--db", f"sqlite:///{tmp_path}/e.db"]) == 0

    out = run_local(tmp_path, ["--gpus-per-node", "2", "--layouts", "tp2dp2,tp2dp1", "--job-name", "apart"],
                    [SCRIPT, "--steps", "400", "--log", str(tmp_path / "steps.log"), "--lr-log",
                     str(tmp_path / "lr.log"), "--step-sleep", "0.2", "--sleep-while", str(pace), "--undeclared"],
                    drive, check=False)
    said = "workers disagree on the learning rate at step"
    fix = "after the grow pp1tp2dp1 -> pp1tp2dp2: declare the scheduler to join(scheduler=...)"
    line = next((x for x in out.splitlines() if said in x and "stopping the job" in x), None)
    assert line is not None and fix in line, out[-4000:]
    store = Store(f"sqlite:///{tmp_path}/e.db")
    job = store.find_job("apart")
    assert job.state == "failed" and said in store.why_failed(job.id), job
    assert max(r[0] for r in mixer_rows(tmp_path / "steps.log")) < 400


def test_without_log_files_the_terminal_gets_one_launcher_line_per_migration(tmp_path: Path) -> None:
    """No --log-dir: the workers' output is elastic-launch's, the user's terminal. The runtime's own lines
    (every worker's "event 1: sent ... MB ... windows") go to <checkpoint dir>.logs/runtime-dev<D>.log instead,
    and the terminal says the migration once, in the launcher's words; the script's own output stays there."""
    out = run_local(tmp_path, ["--gpus-per-node", "2", "--layouts", "tp2dp2,tp2dp1", "--job-name", "quiet"],
                    [SCRIPT, "--steps", "12", "--log", str(tmp_path / "steps.log"), "--lr-log", str(tmp_path / "lr.log"),
                     "--step-sleep", "0.2"], lambda alive: shrink(tmp_path, "quiet", "pp1tp2dp1", alive), logs=False)
    assert "[runtime dev" not in out and "event 1: sent" not in out, out[-4000:]
    # auto mode claims no restart-mode layout before it knows, and says the live layouts once it does
    assert "restart mode, pp1tp1dp4" not in out and "live mode, layouts by node count: 1 node: pp1tp2dp1, 2 " \
        "nodes: pp1tp2dp2" in out, out[-4000:]
    assert len([x for x in out.splitlines() if "(live, at step" in x]) == 1, out[-4000:]
    folder = tmp_path / "checkpoints" / "quiet.logs"
    assert folder.name in out  # the launcher says where they went
    said = {p.name: p.read_text() for p in folder.glob("runtime-dev*.log")}
    assert sorted(said) == [f"runtime-dev{d}.log" for d in range(4)] and "event 1: sent" in said["runtime-dev0.log"]
