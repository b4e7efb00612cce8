"""Background safety checkpoints in LIVE mode (launcher.runtime.ckpt.Safety) under
`elastic-launch --backend local --checkpoint-every N`, with real worker processes.

  * pipeline parallel (examples/pipeline_live.py, pp2 on 2 one-device nodes): device 1 is SIGKILLed
    ($ELASTIC_FAULT=1:ckpt:4) inside the background write of step 4's checkpoint, after its own files,
    before the metadata. Step 4's folder never becomes a `step-4`, so the launcher restores the job on the
    node left (pp1) from step 2's, the newest complete one; the steps since run again.
  * tensor + data parallel (examples/mixer_live.py, tp2dp2) and pipeline + data parallel
    (examples/pipeline_live.py, pp2dp2: each stage writes its own names) on 2 x 2: checkpoints written
    while training goes on hold exactly the state of their step.
  * FSDP2 x TP (examples/titan_live.py, tp2fsdp2: every piece a quarter of its tensor, held once): a killed
    rank's shard comes back from the newest checkpoint, bit for bit.
  * the reference GPT through the API (tests/examples/gpt_script.py: a model that shards itself and gives
    its manifest): tp2 with safety checkpoints, then `elastic-launch --resume` on one device goes on from
    the newest complete one; every loss equals the one-process reference trainer's (within 1e-5).

Oracles, sharing no code with the runtime: the checkpoints are read back with torch's own DCP converter
(dcp_to_torch_save, one process) and compared with the whole state of that step -- from a one-process
plain-PyTorch replay of the pipeline example, or the mixer script's own full-tensor dumps -- and with
the registered data position; the losses equal the replay's bit for bit, steps after the checkpoint
included."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from db import Store
from tests.examples.harness import ROOT, mixer_rows, run_local
from tests.launcher.loop.test_faults import read_losses, reference_losses

BATCH, MICRO = 8, 2


def _launch(tmp_path: Path, script: str, args: list[str], launch: list[str], log_flag: str = "--log",
            env: dict[str, str] | None = None) -> list:
    """Run `script` (a path under the repository) under elastic-launch (harness.run_local) to its end, its step
    log passed as `log_flag`; returns that log's rows (mixer_rows for the examples, read_losses otherwise)."""
    log = tmp_path / "steps.log"
    out = run_local(tmp_path, ["--job-name", "ck", "--checkpoint-dir", str(tmp_path / "ck"), *launch],
                    [str(ROOT / script), log_flag, str(log), *args], lambda alive: None, env)
    (tmp_path / "launch.out").write_text(out)  # elastic-launch's own output, for a failure's message
    return mixer_rows(log) if script.startswith("examples/") else read_losses(log)


def _read_back(folder: Path, tmp_path: Path) -> tuple[dict[str, torch.Tensor], int, dict]:
    """A checkpoint folder read by torch alone: (whole tensors by FQN, step, registered objects' state)."""
    import pickle

    out = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    sd = torch.load(out, weights_only=False)
    return sd["state"], int(sd["run"]["step"]), pickle.loads(sd["run"]["extras"])


def _pipeline_example():
    spec = importlib.util.spec_from_file_location("pipeline_live_ckpt", ROOT / "examples" / "pipeline_live.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _replay(steps: int) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """examples/pipeline_live.py on one process, plain PyTorch, DP 1: per step the microbatches' forward and
    backward in order, gradients / microbatches (GPipe's mean), Adam; one thread like the workers."""
    ex, threads = _pipeline_example(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ex.Stack()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        names = {id(p): n for n, p in model.named_parameters()}
        states, losses = [], []
        for step in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            x, y = ex.batch(step, BATCH, 0, 1)
            mb = []
            for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
                loss = nn.functional.mse_loss(model(xm), ym)
                loss.backward()
                mb.append(loss.detach())
            for p in model.parameters():
                p.grad = p.grad / MICRO
            opt.step()
            losses.append(torch.stack(mb).mean().item())
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            for p, st in opt.state.items():
                state.update({f"optim.state.{names[id(p)]}.{k}": v.detach().clone() for k, v in st.items()})
            states.append(state)
        return states, losses
    finally:
        torch.set_num_threads(threads)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for k in want:
        assert torch.equal(got[k].reshape(want[k].shape), want[k]), (what, k)


def test_pipeline_worker_killed_inside_the_background_write_restores_the_newest_complete_one(tmp_path: Path) -> None:
    steps = 10
    rows = _launch(tmp_path, "examples/pipeline_live.py", ["--steps", str(steps), "--global-batch", str(BATCH),
                                                  "--microbatches", str(MICRO), "--step-sleep", "0.1"],
                   ["--nnodes", "1:2", "--gpus-per-node", "1", "--layouts", "pp2,pp1", "--checkpoint-every", "2"],
                   env={"ELASTIC_FAULT": "1:ckpt:4"})
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("*.log"))
    assert "fault injection: SIGKILL at ckpt 4" in logs  # it died inside step 4's write
    store = Store(f"sqlite:///{tmp_path}/e.db")
    job = store.find_job("ck")
    (m,) = store.recent_migrations(job.id, limit=10)
    assert (m.trigger, m.status, m.from_layout, m.to_layout) == ("failure", "succeeded", "pp2tp1dp1", "pp1tp1dp1")
    assert m.at_step == 2 and m.error.startswith("restored from checkpoint at step 2:"), m  # step 4's was partial
    assert job.state == "finished"
    # the first run reached step 4 or 5 (its step 5 may have committed before the kill), then 3.. again on pp1
    cut = next(i for i, r in enumerate(rows) if r[1] == "pp1tp1dp1")
    assert [r[0] for r in rows[:cut]] in (list(range(1, 5)), list(range(1, 6))), rows
    assert [r[0] for r in rows[cut:]] == list(range(3, steps + 1)), rows
    assert {r[1] for r in rows[:cut]} == {"pp2tp1dp1"} and {r[1] for r in rows[cut:]} == {"pp1tp1dp1"}
    assert [r[2] for r in rows] == [BATCH * s for s, *_ in rows]  # the data position came back with the state
    states, losses = _replay(steps)
    assert [r[3] for r in rows] == [losses[s - 1] for s, *_ in rows]  # bit for bit, the steps run again too
    # one complete checkpoint is always there: the newest and the one before it, each exactly its step
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["step-10", "step-8"]
    for s in (8, 10):
        state, step, extras = _read_back(ck / f"step-{s}", tmp_path)
        assert step == s and extras == {"data": {"samples": BATCH * s}}
        _same(state, states[s - 1], f"step-{s}")


@pytest.mark.parametrize("script, layout, name", [("examples/mixer_live.py", "tp2dp2", "pp1tp2dp2"),
                                                   ("examples/pipeline_live.py", "pp2dp2", "pp2tp1dp2")])
def test_checkpoints_written_in_the_background_hold_their_step(tmp_path: Path, script: str, layout: str,
                                                               name: str) -> None:
    steps, dump = 9, tmp_path / "dump"
    dump.mkdir()
    rows = _launch(tmp_path, script, ["--steps", str(steps), "--global-batch", str(BATCH), "--dump-dir", str(dump)],
                   ["--nnodes", "2", "--gpus-per-node", "2", "--layouts", layout, "--checkpoint-every", "3"])
    assert [r[0] for r in rows] == list(range(1, steps + 1)) and {r[1] for r in rows} == {name}
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["step-6", "step-9"]
    for s in (6, 9):
        state, step, extras = _read_back(ck / f"step-{s}", tmp_path)
        assert step == s and extras == {"data": {"samples": BATCH * s}}
        _same(state, torch.load(dump / f"after-{s}.pt"), f"step-{s}")  # the script's own gathered state


def test_reference_gpt_through_the_api_resumes_from_its_newest_background_checkpoint(tmp_path: Path) -> None:
    # tp2 on one node, a checkpoint every 2 steps (the last of 5 steps is 4); then --resume on one device
    gpt = ("tests/examples/gpt_script.py", ["--steps", "5"])
    rows = _launch(tmp_path, gpt[0], gpt[1], ["--nnodes", "1", "--gpus-per-node", "2", "--layouts", "tp2",
                                              "--checkpoint-every", "2"], log_flag="--loss-file")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-2", "step-4"]
    rows = _launch(tmp_path, gpt[0], ["--steps", "8"], ["--resume", "--nnodes", "1", "--gpus-per-node", "1",
                                                        "--layouts", "pp1", "--checkpoint-every", "0"],
                   log_flag="--loss-file")
    assert [(s, lay) for s, _v, lay in rows] == [(s, "pp1tp2dp1") for s in range(1, 6)] + \
        [(s, "pp1tp1dp1") for s in range(5, 9)], rows  # step 5 again: it came after the newest checkpoint
    ref = reference_losses(8)
    for st, v, lay in rows:
        assert abs(v - ref[st - 1]) <= 1e-5 * abs(ref[st - 1]), (st, v, ref[st - 1], lay)


def test_recovery_from_replicas_while_a_background_write_is_in_flight(tmp_path: Path) -> None:
    # a checkpoint at every step (each waits for the one before), so step 4's write is most likely still going
    # when device 3 dies in step 5 (before its vote): the survivors finish or drop it (its collective lost a
    # member) before they move onto tp2dp1 from the replicas, and the checkpoints after it are whole
    steps, dump = 9, tmp_path / "dump"
    dump.mkdir()
    rows = _launch(tmp_path, "examples/mixer_live.py", ["--steps", str(steps), "--dump-dir", str(dump)],
                   ["--nnodes", "2", "--gpus-per-node", "2", "--layouts", "tp2dp2,tp2dp1", "--checkpoint-every", "1"],
                   env={"ELASTIC_FAULT": "3:step:5"})
    assert [r[0] for r in rows] == list(range(1, steps + 1)), rows  # every step once
    assert [r[1] for r in rows] == ["pp1tp2dp2"] * 4 + ["pp1tp2dp1"] * (steps - 4), rows
    store = Store(f"sqlite:///{tmp_path}/e.db")
    recorded = store.recent_migrations(store.find_job("ck").id, limit=10)
    assert len(recorded) == 1, ([(r.trigger, r.status, r.at_step, r.error) for r in recorded],
                                (tmp_path / "launch.out").read_text())
    (m,) = recorded
    assert (m.trigger, m.status, m.at_step) == ("failure", "succeeded", 4), (m.trigger, m.status, m.at_step, m.error)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-8", "step-9"]
    for s in (8, 9):
        state, step, extras = _read_back(tmp_path / "ck" / f"step-{s}", tmp_path)
        assert step == s and extras == {"data": {"samples": BATCH * s}}
        _same(state, torch.load(dump / f"after-{s}.pt"), f"step-{s}")


def test_fsdp_without_replicas_restores_a_lost_shard_from_its_checkpoint(tmp_path: Path) -> None:
    """FSDP2 x TP (examples/titan_live.py, tp2fsdp2 on 2 x 2) holds each piece once: once step 4's checkpoint is
    on disk the test SIGKILLs device 3's worker; its quarter of the state has no other holder, so the launcher
    restores the job from the newest complete checkpoint. The state the step after it starts from again is,
    bit for bit, the whole state that checkpoint's step left (the script's own full_tensor dumps), and every
    step after it runs again."""
    from tests.examples.harness import assert_state_carried, kill_worker, wait

    steps, dump, log = 10, tmp_path / "dump", tmp_path / "steps.log"
    dump.mkdir()

    def drive(alive) -> None:
        wait(lambda: (tmp_path / "ck" / "step-4").is_dir(), 120, "step 4's checkpoint", alive)
        kill_worker(tmp_path, 3)

    out = run_local(tmp_path, ["--job-name", "ck", "--checkpoint-dir", str(tmp_path / "ck"), "--nnodes", "2",
                               "--gpus-per-node", "2", "--layouts", "tp2fsdp2", "--checkpoint-every", "2"],
                    [str(ROOT / "examples/titan_live.py"), "--log", str(log), "--steps", str(steps), "--dump-dir",
                     str(dump), "--step-sleep", "0.3"], drive)
    rows = mixer_rows(log)
    store = Store(f"sqlite:///{tmp_path}/e.db")
    (m,) = store.recent_migrations(store.find_job("ck").id, limit=10)
    assert (m.trigger, m.status, m.from_layout, m.to_layout) == \
        ("failure", "succeeded", "pp1tp2dp1fsdp2", "pp1tp2dp1fsdp2"), (m, out)
    at = m.at_step
    assert at >= 4 and m.error.startswith(f"restored from checkpoint at step {at}:"), m
    cut = next(i for i in range(1, len(rows)) if rows[i][0] <= rows[i - 1][0])  # where the steps begin again
    assert [r[0] for r in rows[:cut]] == list(range(1, cut + 1)) and [r[0] for r in rows[cut:]] == \
        list(range(at + 1, steps + 1)), rows
    assert [r[2] for r in rows] == [8 * s for s, *_ in rows]  # the data position came back with the state
    assert_state_carried(dump, steps)  # step at+1 began from step at's state, restored from the checkpoint
