"""The examples run as a user runs them on the real 4-node Slurm testbed: an sbatch script whose one
line is `elastic-launch --backend slurm ... -- python examples/<x>.py`, 4 nodes x 2 GPUs; `elastic
resize` shrinks the job to 2 nodes (Slurm takes the other 2 back: squeue/scontrol show 2) and grows it
to 4 again (a companion job brings 2 nodes), then the job ends on its own.

Live mode (examples/mixer_live.py, TP2 x DP4 -> TP2 x DP2 -> TP2 x DP4): the whole state is bit-exact
across every migration (the script's own full-tensor dumps), every step runs once, the data position
travels. Restart mode (examples/ddp_restart.py --save-on-term): each restart starts with SIGTERM
delivered to the tasks (not srun's SIGKILL), so the script checkpoints where it stopped and the next
world goes on from exactly that step; the loss curve equals a one-process replay of the script.
`elastic jobs --json` and `elastic history --json` show the job, its mode and both resizes with their
pause."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from db import Store
from launcher.backends.slurm.client import SlurmCommands, SlurmError
from launcher.cli import main as elastic
from tests.examples.harness import ROOT, assert_state_carried, ddp_reference_losses, ddp_rows, mixer_rows, wait
from tests.launcher.conftest import slurm_testbed  # noqa: F401 -- the shared session fixture

pytestmark = pytest.mark.slurm
NODES = {"n1", "n2", "n3", "n4"}
ENDED = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "TIMEOUT")  # Slurm's states of a job that has ended


def _sbatch(tmp_path: Path, name: str, url: str, launch: str, program: str, nodes: int = 4) -> str:
    return f"""#!/bin/bash
#SBATCH --nodes={nodes} --ntasks-per-node=2 --gres=gpu:2 --job-name={name} --output={tmp_path}/batch.out --chdir={tmp_path}
export PYTHONPATH={ROOT}
exec {sys.executable} -m launcher.launch --backend slurm --nnodes {nodes // 2}:{nodes} --gpus-per-node 2 {launch} --db {url} \\
    --log-dir {tmp_path}/logs --poll 0.1 -- python {ROOT}/examples/{program}
"""


class Run:
    """One sbatch'ed example on the testbed, driven like a user drives it."""

    def __init__(self, testbed, tmp_path: Path, name: str, launch: str, program: str, nodes: int = 4) -> None:
        self.env = {**os.environ, **testbed.env()}
        self.slurm = SlurmCommands(env=testbed.env())
        self.name, self.url, self.out = name, f"sqlite:///{tmp_path}/e.db", tmp_path / "batch.out"
        self.slurm_id = self.slurm.submit(_sbatch(tmp_path, name, self.url, launch, program, nodes))
        self.store: Store | None = None

    def state(self) -> str | None:
        try:
            return self.slurm.job_info(self.slurm_id).state
        except SlurmError:  # slurmctld busy for a moment (the waits are bounded by their timeouts)
            return None

    def alive(self) -> bool:
        return self.state() not in ENDED

    def wait(self, cond, what: str, timeout: float = 120) -> None:
        wait(cond, timeout, f"{what} (batch output: {self.out})", self.alive)

    def job(self):
        if self.store is None:
            try:
                self.store = Store(self.url, create=False)
            except Exception:  # noqa: BLE001 -- the launcher has not created it yet
                return None
        return self.store.find_job(self.name)

    def resize(self, nodes: int, count: int) -> None:
        """`elastic resize` once the job shows its layout (before, the command refuses, as it tells the user:
        the launcher records a restart-mode world at its first poll after the world formed), then until the
        request is carried out (the `count`-th one)."""
        self.wait(lambda: self.job() is not None and self.store.current_rank_map(self.job().id) is not None,
                  "the job's layout recorded")
        assert elastic(["resize", self.name, "--nodes", str(nodes), "--db", self.url]) == 0
        jid = self.job().id
        self.wait(lambda: len([r for r in self.store.list_requests(jid) if r.status != "pending"]) >= count,
                  f"resize request {count} carried out", timeout=150)
        req = max(self.store.list_requests(jid), key=lambda r: r.id)
        assert req.status == "done", req.message

    def slurm_nodes(self) -> tuple[set[str], int]:
        """The job's nodes as scontrol shows them, and squeue's node count."""
        count = subprocess.run(["squeue", "--noheader", "-o", "%D", "-j", str(self.slurm_id)], env=self.env,
                               capture_output=True, text=True, check=True).stdout.strip()
        return set(self.slurm.job_info(self.slurm_id).nodes), int(count)

    def companions(self):
        return [j for j in self.slurm.jobs() if j.name.startswith(f"{self.name}-companion-")]

    def shrink_then_grow(self, on_two: callable) -> set[str]:
        """4 -> 2 nodes (checked in Slurm), `on_two()` to wait for training there, then 2 -> 4; returns
        the nodes Slurm took back."""
        self.resize(2, 1)
        kept, count = self.slurm_nodes()
        assert count == 2 and len(kept) == 2, (kept, count)
        released = NODES - kept
        assert {n.name for n in self.store.list_nodes(self.job().id) if n.state == "released"} == released
        on_two()
        self.resize(4, 2)
        (comp,) = self.companions()
        assert set(comp.nodes) == released and comp.state == "RUNNING"
        assert self.slurm_nodes() == (kept, 2), "the job itself never grows: the companion holds the other 2"
        return released

    def finish(self) -> None:
        self.wait(lambda: not self.alive(), "the job to end", timeout=180)
        assert self.state() == "COMPLETED", self.out.read_text()[-3000:]

    def cancel(self) -> None:
        subprocess.run(["scancel", str(self.slurm_id)], env=self.env, capture_output=True, check=False)
        subprocess.run(["scancel", f"--name={self.name}-companion-1"], env=self.env, capture_output=True, check=False)

    def cli_json(self, capsys, *args: str):
        capsys.readouterr()
        assert elastic([*args, "--db", self.url, "--json"]) == 0
        return json.loads(capsys.readouterr().out)


@pytest.mark.slurm_core
def test_mixer_live_on_slurm_shrinks_4_to_2_and_grows_back_bit_exact(slurm_testbed, tmp_path, capsys):
    log, dump, steps = tmp_path / "steps.log", tmp_path / "dump", 68  # grow committed at step 36 when measured
    dump.mkdir()
    pace = tmp_path / "pace"  # the script's --step-sleep applies while it exists: until both resizes are done
    pace.touch()
    run = Run(slurm_testbed, tmp_path, "mixer-sl", "--layouts tp2dp4,tp2dp2",
              f"mixer_live.py --steps {steps} --log {log} --dump-dir {dump} --step-sleep 0.25 --sleep-while {pace}")
    try:
        run.wait(lambda: len(mixer_rows(log)) >= 3, "3 steps on tp2dp4", timeout=150)
        assert (run.job().state, run.job().mode, run.job().slurm_job_id) == ("running", "live", str(run.slurm_id))

        def two_steps_on_two_nodes() -> None:
            first = next(r[0] for r in mixer_rows(log) if r[1] == "pp1tp2dp2")
            run.wait(lambda: mixer_rows(log)[-1][0] >= first + 1, "two steps on tp2dp2")

        run.shrink_then_grow(two_steps_on_two_nodes)
        pace.unlink()
        run.finish()
    finally:
        run.cancel()
    rows = mixer_rows(log)
    assert [r[0] for r in rows] == list(range(1, steps + 1)), "every step exactly once"
    assert [r[2] for r in rows] == [8 * s for s in range(1, steps + 1)], "the data position travelled"
    layouts = [r[1] for r in rows]
    changes = [(layouts[s - 1], layouts[s]) for s in range(1, steps) if layouts[s] != layouts[s - 1]]
    assert changes == [("pp1tp2dp4", "pp1tp2dp2"), ("pp1tp2dp2", "pp1tp2dp4")], changes
    assert_state_carried(dump, steps)
    (job,) = run.cli_json(capsys, "jobs")
    assert (job["name"], job["state"], job["mode"], job["slurm_job_id"]) == ("mixer-sl", "finished", "live",
                                                                              str(run.slurm_id))
    assert (job["layout"], job["last_step"], set(job["nodes"])) == ("pp1tp2dp4", steps, NODES)
    hist = sorted(run.cli_json(capsys, "history"), key=lambda h: h["id"])
    assert [(h["kind"], h["trigger"], h["status"], h["from_layout"], h["to_layout"]) for h in hist] == [
        ("live", "resize", "succeeded", "pp1tp2dp4", "pp1tp2dp2"),
        ("live", "resize", "succeeded", "pp1tp2dp2", "pp1tp2dp4")]
    assert hist[1]["bytes_moved"] > 0  # the grow fills the companion's nodes
    assert all(h["pause_s"] is not None and h["pause_s"] > 0 for h in hist), hist


def test_ddp_restart_on_slurm_gets_sigterm_and_resumes_where_it_stopped(slurm_testbed, tmp_path, capsys):
    log, steps = tmp_path / "steps.log", 28  # the 4-worker world reached step 10 in a measured run
    pace = tmp_path / "pace"  # the script's --step-sleep applies while it exists: until both resizes are done
    pace.touch()
    run = Run(slurm_testbed, tmp_path, "ddp-sl", "--term-timeout 30",
              f"ddp_restart.py --steps {steps} --ckpt-every 1000 --ckpt-dir {tmp_path}/ckpt --log {log} "
              f"--step-sleep 0.3 --sleep-while {pace} --save-on-term")
    try:
        run.wait(lambda: len(ddp_rows(log)) >= 3, "3 steps on 8 workers", timeout=150)
        assert (run.job().state, run.job().mode) == ("running", "restart")
        run.shrink_then_grow(lambda: run.wait(lambda: len([r for r in ddp_rows(log) if r[3] == 1]) >= 2,
                                              "two steps on 4 workers"))
        pace.unlink()
        run.finish()
    finally:
        run.cancel()
    rows = ddp_rows(log)
    assert sorted({(r[3], r[2]) for r in rows}) == [(0, 8), (1, 4), (2, 8)], rows  # worlds: 8, then 4, then 8
    # SIGTERM reached the script (srun would have SIGKILLed it): it checkpointed the step it stopped at
    # (its only checkpoints: --ckpt-every is beyond --steps), and the next world went on from exactly there
    assert [r[0] for r in rows] == list(range(1, steps + 1)), rows
    reference = ddp_reference_losses(steps)
    for (step, loss, _w, _r), want in zip(rows, reference):
        assert loss == pytest.approx(want, rel=1e-4, abs=1e-6), (step, loss, want)
    (job,) = run.cli_json(capsys, "jobs")
    assert (job["name"], job["state"], job["mode"], job["slurm_job_id"]) == ("ddp-sl", "finished", "restart",
                                                                              str(run.slurm_id))
    hist = sorted(run.cli_json(capsys, "history"), key=lambda h: h["id"])
    assert [(h["kind"], h["trigger"], h["status"], h["from_layout"], h["to_layout"]) for h in hist] == [
        ("restart", "resize", "succeeded", "pp1tp1dp8", "pp1tp1dp4"),
        ("restart", "resize", "succeeded", "pp1tp1dp4", "pp1tp1dp8")]
    assert all(h["pause_s"] > 0 and h["stop_s"] is not None and h["start_s"] is not None for h in hist), hist
    # every worker ended on its own after SIGTERM: no restart waited out --term-timeout to SIGKILL it
    notes = [n for m in run.store.recent_migrations(run.job().id, limit=5) for n in m.plan_summary.get("notes", [])]
    assert not [n for n in notes if "did not exit within --term-timeout" in n], notes
    # rank 0 (on the batch node n1 in every world) said so in its step's log, once per restart
    assert (tmp_path / "logs" / "step-n1.log").read_text().count("SIGTERM: checkpointed step") == 2
