"""examples/pipeline_live.py under `elastic-launch --backend local` in LIVE mode with PIPELINE parallelism,
real worker processes on 2 nodes x 2 devices resized with `elastic resize`, one job per test:
  * pp2dp2 -> pp1dp2 (the two stages merge) -> pp2dp2, then device 3 is SIGKILLed ($ELASTIC_FAULT): the job
    goes on on pp1dp2 from the DP replicas left, every step exactly once;
  * pp4 -> pp2 (every rank's blocks change owner) -> pp4, then the test SIGKILLs device 3 (its stage has no
    replica): the job restarts from its safety checkpoint; the steps since run again, bit for bit;
  * TP inside the stages: pp2tp2dp1 -> pp1tp2dp1, `elastic suspend`, `elastic-launch --resume` on 2 nodes
    (pp2tp2dp1 from the checkpoint written on pp1tp2dp1), every step exactly once;
  * HSDP (hsdp2x2: 2 replicas of 2 FSDP2 shards), device 3 SIGKILLed: the job goes on on pp2 from the
    shards of the replica left (each stage's whole parameters gathered from FSDP pieces), every step once.
Oracle: one process trains the same model on the same steps with plain PyTorch (no launcher.runtime, no
torch.distributed): the same DP shares and microbatches, gradients summed in microbatch order and divided
as GPipe and the DP mean do, and under TP the arithmetic of 2-way Megatron TP written out (_block). The whole
state the script gathers after every step, and every logged loss, equal the oracle's bit for bit; each live
migration moves exactly the bytes each new rank's stage needs and its device did not hold."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from db import Store
from tests.examples.harness import ROOT, kill_worker, mixer_rows, run_local, shrink, shrink_and_grow, wait

STEPS, BATCH, MICRO, DP = 48, 8, 2, 2
KILL = STEPS - 6  #: device 3 is SIGKILLed ($ELASTIC_FAULT) in its first step from this one on: after the grow


def _example():
    spec = importlib.util.spec_from_file_location("pipeline_live_example", ROOT / "examples" / "pipeline_live.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _oracle(ex, steps: int, dp: int, tp: int = 1) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """State after each step and DP rank 0's loss of each step, trained in one process on one thread
    (the workers get OMP_NUM_THREADS=1, torchrun's default; LayerNorm's weight gradient sums in another
    order on two threads), on `dp` DP shares and with the arithmetic of `tp`-way TP (_block)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(ex, steps, dp, tp)
    finally:
        torch.set_num_threads(threads)


def _block(b: nn.Module, x: torch.Tensor, tp: int) -> torch.Tensor:
    """One block computed as `tp`-way Megatron TP computes it, in one process: `up` cut by output rows
    (column-parallel), `down` by input columns (row-parallel); each of the `tp` partial sums of `down`
    carries bias / tp (DTensor turns the replicated bias into a partial one that way) and the partials are
    summed (the all-reduce). With tp == 2 every all-reduce adds two numbers, so its order does not matter;
    autograd then sums the input gradients of the `up` pieces as the backward all-reduce does."""
    n, h = b.norm(x), b.up.out_features // tp
    out = None
    for i in range(tp):
        a = torch.relu(F.linear(n, b.up.weight[i * h:(i + 1) * h], b.up.bias[i * h:(i + 1) * h]))
        part = F.linear(a, b.down.weight[:, i * h:(i + 1) * h]) + b.down.bias / tp
        out = part if out is None else out + part
    return x + out


def _forward(model: nn.Module, x: torch.Tensor, tp: int) -> torch.Tensor:
    if tp == 1:
        return model(x)
    x = model.embed(x)
    for b in model.blocks:
        x = _block(b, x, tp)
    return model.head(x)


def _train(ex, steps: int, dp: int, tp: int) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    model = ex.Stack()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    states, losses = [], []
    for step in range(1, steps + 1):
        grads = []
        for d in range(dp):
            model.zero_grad(set_to_none=True)
            x, y = ex.batch(step, BATCH, d, dp)
            mb = []
            for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):  # GPipe: forward+backward per microbatch, in order
                loss = nn.functional.mse_loss(_forward(model, xm, tp), ym)
                loss.backward()
                mb.append(loss.detach())
            grads.append([p.grad / MICRO for p in model.parameters()])
            if d == 0:
                losses.append(torch.stack(mb).mean().item())
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = gs[0] if dp == 1 else (gs[0] + gs[1]) / dp
        opt.step()
        names = {id(p): n for n, p in model.named_parameters()}
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for p, st in opt.state.items():
            state.update({f"optim.state.{names[id(p)]}.{k}": v.detach().clone() for k, v in st.items()})
        states.append(state)
    return states, losses


def _assert_states(dump: Path, states: list[dict[str, torch.Tensor]]) -> None:
    """The whole state the script saved after each step equals the oracle's, bit for bit."""
    for step, want in enumerate(states, start=1):
        got = torch.load(dump / f"after-{step}.pt")
        assert got.keys() == want.keys(), (step, sorted(got.keys() ^ want.keys()))
        for k in want:
            assert torch.equal(got[k], want[k]), (step, k)


def _args(dump: Path) -> list[str]:
    """The script's flags (the step sleep leaves the resizes time to land before the last step)."""
    return ["--steps", str(STEPS), "--global-batch", str(BATCH), "--microbatches", str(MICRO), "--dump-dir", str(dump),
            "--step-sleep", "0.2"]


def _first_runs(rows: list[tuple[int, str, int, float]]) -> list[tuple[int, str, int, float]]:
    """The log's rows with the steps a restore from a checkpoint ran again dropped; those must have given
    the same loss and data position as their first run, bit for bit."""
    first: dict[int, tuple] = {}
    for r in rows:
        if r[0] in first:
            assert (r[2], r[3]) == first[r[0]][2:], (r, first[r[0]])
        else:
            first[r[0]] = r
    return [first[s] for s in sorted(first)]


def _changes(layouts: list[str]) -> list[str]:
    """The layouts the job trained on, in order, each once per stretch."""
    return [x for i, x in enumerate(layouts) if i == 0 or layouts[i - 1] != x]


def _bytes_each_move_needs(maps, size: dict[str, int]) -> list[int]:
    """Per migration between the recorded rank maps: what each new rank's stage needs and its device did
    not hold before (stages from the explicit table STAGES), counted from the oracle's tensor sizes."""
    want = []
    for before, after in zip(maps, maps[1:]):
        held = {(e.node, e.gpu): _names(before.layout, e.pp, size) for e in before.entries}
        want.append(sum(size[k] for e in after.entries
                        for k in _names(after.layout, e.pp, size) - held.get((e.node, e.gpu), set())))
    return want


def test_pipeline_stages_change_live_and_a_dead_worker_is_recovered_from_its_replica(tmp_path: Path) -> None:
    # pp2dp2 -> (shrink) pp1dp2 -> (grow) pp2dp2 -> device 3 (stage 1, DP rank 1) SIGKILLed -> pp1dp2 from replicas
    dump = tmp_path / "dump"
    dump.mkdir()
    rows = shrink_and_grow(tmp_path, "pipe", "pp2dp2,pp1dp2", "pp1tp1dp2", "pipeline_live.py", _args(dump),
                           env={"ELASTIC_FAULT": f"3:step:{KILL}"})
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)), rows  # every step once, none lost or repeated
    assert [r[2] for r in rows] == [BATCH * s for s in range(1, STEPS + 1)]  # the data position travelled
    assert _changes([r[1] for r in rows]) == ["pp2tp1dp2", "pp1tp1dp2", "pp2tp1dp2", "pp1tp1dp2"], rows

    states, losses = _oracle(_example(), STEPS, DP)
    assert [r[3] for r in rows] == losses  # the loss goes on exactly as in one process
    _assert_states(dump, states)

    store = Store(f"sqlite:///{tmp_path}/e.db")
    job = store.find_job("pipe")
    assert (job.state, job.mode) == ("finished", "live")
    maps = store.rank_maps(job.id)
    assert [m.layout for m in maps] == ["pp2tp1dp2", "pp1tp1dp2", "pp2tp1dp2", "pp1tp1dp2"]  # only what trained
    assert ("node1", 1) not in {(e.node, e.gpu) for e in maps[-1].entries}  # device 3
    migs = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    assert [(m.kind, m.trigger, m.status, m.from_layout, m.to_layout) for m in migs] == [
        ("live", "resize", "succeeded", "pp2tp1dp2", "pp1tp1dp2"), ("live", "resize", "succeeded", "pp1tp1dp2", "pp2tp1dp2"),
        ("live", "failure", "succeeded", "pp2tp1dp2", "pp1tp1dp2")], [(m.trigger, m.status, m.error) for m in migs]
    # only what changes owner moves (the recovery takes device 3's stage from its DP replica)
    want = _bytes_each_move_needs(maps, {k: t.numel() * t.element_size() for k, t in states[0].items()})
    assert [m.bytes_moved for m in migs] == want and all(want)


def _grown(rows: list[tuple[int, str, int, float]]) -> int:
    """Steps logged on pp4 after the last one on pp2."""
    last = max(r[0] for r in rows if r[1] == "pp2tp1dp1")
    return sum(r[1] == "pp4tp1dp1" and r[0] > last for r in rows)


def test_pp4_to_pp2_live_and_a_lost_stage_restarts_from_the_safety_checkpoint(tmp_path: Path) -> None:
    # pp4 -> (shrink) pp2: every rank's blocks change; (grow) pp4; after 2 steps there the test SIGKILLs device 3
    # (stage 3, no replica): every worker restarts from the safety checkpoint (--checkpoint-every 2), the
    # steps since it run again and give the same losses and state bit for bit
    dump, log, url = tmp_path / "dump", tmp_path / "steps.log", f"sqlite:///{tmp_path}/e.db"
    dump.mkdir()

    def kill_after_grow(alive) -> None:
        wait(lambda: _grown(mixer_rows(log)) >= 2, 120, "2 steps on pp4 after the grow", alive)
        kill_worker(tmp_path, 3)

    rows = shrink_and_grow(tmp_path, "pp4", "pp4dp1,pp2dp1", "pp2tp1dp1", "pipeline_live.py", _args(dump),
                           launch=["--checkpoint-every", "2"], then=kill_after_grow)
    once = _first_runs(rows)
    assert [r[0] for r in once] == list(range(1, STEPS + 1)), rows
    assert [r[2] for r in once] == [BATCH * s for s in range(1, STEPS + 1)]
    assert _changes([r[1] for r in rows]) == ["pp4tp1dp1", "pp2tp1dp1", "pp4tp1dp1"], rows

    states, losses = _oracle(_example(), STEPS, 1)
    assert [r[3] for r in once] == losses
    _assert_states(dump, states)

    store = Store(url)
    job = store.find_job("pp4")
    assert (job.state, job.mode) == ("finished", "live")
    maps = store.rank_maps(job.id)
    assert [m.layout for m in maps] == ["pp4tp1dp1", "pp2tp1dp1", "pp4tp1dp1", "pp4tp1dp1"]
    migs = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    assert [(m.trigger, m.status, m.from_layout, m.to_layout) for m in migs] == [
        ("resize", "succeeded", "pp4tp1dp1", "pp2tp1dp1"), ("resize", "succeeded", "pp2tp1dp1", "pp4tp1dp1"),
        ("failure", "succeeded", "pp4tp1dp1", "pp4tp1dp1")], [(m.trigger, m.status, m.error) for m in migs]
    want = _bytes_each_move_needs(maps[:3], {k: t.numel() * t.element_size() for k, t in states[0].items()})
    assert [m.bytes_moved for m in migs[:2]] == want and all(want)
    restored = migs[2].at_step
    assert "restored from checkpoint" in migs[2].error and restored % 2 == 0 and restored >= 2
    again = sorted({r[0] for r in rows if [x[0] for x in rows].count(r[0]) > 1})  # logged before and after it
    assert again == list(range(restored + 1, restored + 1 + len(again))), (restored, again)
    assert len(again) <= migs[2].steps_lost <= len(again) + 1  # + a step committed but not yet logged


def test_tp_inside_pipeline_stages_live_then_suspend_and_resume_on_another_pp_layout(tmp_path: Path) -> None:
    # pp2tp2dp1 (each stage a TP pair on one node) -> (shrink) pp1tp2dp1 -> `elastic suspend` ->
    # `elastic-launch --resume` on 2 nodes: pp2tp2dp1 again, from the checkpoint the suspend wrote
    from launcher.cli import main as elastic

    dump = tmp_path / "dump"
    dump.mkdir()
    launch = ["--gpus-per-node", "2", "--layouts", "pp2tp2dp1,pp1tp2dp1", "--job-name", "tp"]
    program = ["pipeline_live.py", "--log", str(tmp_path / "steps.log"), *_args(dump)]

    def shrink_then_suspend(alive) -> None:
        shrink(tmp_path, "tp", "pp1tp2dp1", alive)
        assert elastic(["suspend", "tp", "--db", f"sqlite:///{tmp_path}/e.db"]) == 0

    run_local(tmp_path, launch, program, shrink_then_suspend)
    store = Store(f"sqlite:///{tmp_path}/e.db")
    job = store.find_job("tp")
    assert job.state == "suspended" and job.checkpoint_path.endswith(f"step-{job.checkpoint_step}"), job
    run_local(tmp_path, [*launch, "--resume"], [*program, "--step-sleep", "0"], lambda alive: None)  # nothing to wait for

    rows = mixer_rows(tmp_path / "steps.log")
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)), rows  # every step once across the suspend
    assert [r[2] for r in rows] == [BATCH * s for s in range(1, STEPS + 1)]
    assert _changes([r[1] for r in rows]) == ["pp2tp2dp1", "pp1tp2dp1", "pp2tp2dp1"], rows
    assert rows[job.checkpoint_step][1] == "pp2tp2dp1" and rows[job.checkpoint_step - 1][1] == "pp1tp2dp1"

    states, losses = _oracle(_example(), STEPS, 1, tp=2)
    assert [r[3] for r in rows] == losses
    _assert_states(dump, states)
    job = store.find_job("tp")
    assert job.state == "finished"
    migs = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    assert [(m.trigger, m.status, m.from_layout, m.to_layout) for m in migs][0] == (
        "resize", "succeeded", "pp2tp2dp1", "pp1tp2dp1"), [(m.trigger, m.status, m.error) for m in migs]


#: the tensors (by name prefix) each stage holds when the 4 blocks are split into 2 or 4 stages
STAGES = {2: {0: ("embed.", "blocks.0.", "blocks.1."), 1: ("blocks.2.", "blocks.3.", "head.")},
          4: {0: ("embed.", "blocks.0."), 1: ("blocks.1.",), 2: ("blocks.2.",), 3: ("blocks.3.", "head.")}}


def _names(layout: str, pp_rank: int, size: dict) -> set[str]:
    """Names (model and optimizer state) that pipeline stage `pp_rank` of `layout` holds."""
    if layout.startswith("pp1"):
        return set(size)
    stages = STAGES[int(layout[2:layout.index("tp")])]
    return {k for k in size if k.removeprefix("optim.state.").startswith(stages[pp_rank])}


def test_a_job_of_new_interpreters_that_ends_one_step_after_a_shrink_finishes(tmp_path: Path) -> None:
    # Every worker a new interpreter (--fresh-processes, as srun starts them). The shrink is asked for
    # while the workers sleep after step 3, so every one sees it after that step and it lands after step
    # 5 (finished steps + 2); the job's 6th step is its last. The two workers that stay tear the old
    # world's groups down once they trained a step on the new one, right before they end: the process
    # waits for that (launcher.runtime.worlds.Worlds.settle_retired); before, it aborted in the interpreter's teardown and the
    # launcher reported the finished job as failed ("no node left").
    from launcher.cli import main as elastic

    log, pace, db = tmp_path / "steps.log", tmp_path / "pace", f"sqlite:///{tmp_path}/e.db"
    pace.touch()

    def drive(alive) -> None:
        wait(lambda: len(mixer_rows(log)) >= 3, 180, "3 steps on 2 nodes", alive)
        assert elastic(["resize", "last", "--nodes", "1", "--db", db]) == 0
        store = Store(db)
        wait(lambda: store.recent_migrations(store.find_job("last").id), 30, "the shrink planned", alive)
        pace.unlink()  # the workers still sleep after step 3; the steps after it run at full speed

    run_local(tmp_path, ["--fresh-processes", "--gpus-per-node", "2", "--layouts", "pp2dp2,pp1dp2", "--job-name",
                         "last"],
              ["pipeline_live.py", "--steps", "6", "--log", str(log), "--step-sleep", "5", "--sleep-while", str(pace)],
              drive)
    rows = mixer_rows(log)
    assert [(r[0], r[1]) for r in rows] == [(s, "pp2tp1dp2") for s in range(1, 6)] + [(6, "pp1tp1dp2")], rows
    store = Store(db)
    job = store.find_job("last")
    assert job.state == "finished"
    assert [(m.trigger, m.status) for m in store.recent_migrations(job.id)] == [("resize", "succeeded")]


def test_hsdp_survives_a_dead_rank_and_goes_on_as_a_pipeline_from_the_replica_left(tmp_path: Path) -> None:
    """hsdp2x2 (pp1: every rank a quarter of the data, half of every tensor, each half twice) loses device 3
    in step 6 ($ELASTIC_FAULT): its half survives on the other replica, and the job moves live to pp2 on the
    devices left (both stages' tensors cut out of FSDP shards). Oracle: the one-process training, the same
    arithmetic up to summation order (4 data ranks' FSDP2 reduce-scatter, then pp2's whole batch)."""
    steps, kill, dump = 12, 6, tmp_path / "dump"
    dump.mkdir()
    out = run_local(tmp_path, ["--nnodes", "2", "--gpus-per-node", "2", "--layouts", "hsdp2x2,pp2", "--job-name", "hsdp"],
                    ["pipeline_live.py", "--log", str(tmp_path / "steps.log"), *_args(dump)[2:], "--steps", str(steps)],
                    lambda alive: None, {"ELASTIC_FAULT": f"3:step:{kill}"})
    rows = mixer_rows(tmp_path / "steps.log")
    assert [r[0] for r in rows] == list(range(1, steps + 1)), (rows, out)  # every step once
    assert [r[1] for r in rows] == ["pp1tp1dp2fsdp2"] * (kill - 1) + ["pp2tp1dp1"] * (steps - kill + 1), rows
    store = Store(f"sqlite:///{tmp_path}/e.db")
    (m,) = store.recent_migrations(store.find_job("hsdp").id, limit=10)
    assert (m.kind, m.trigger, m.status, m.from_layout, m.to_layout) == \
        ("live", "failure", "succeeded", "pp1tp1dp2fsdp2", "pp2tp1dp1"), (m.error, out)
    assert m.bytes_moved > 0
    states, _losses = _oracle(_example(), steps, DP)
    for step, want in enumerate(states, start=1):
        got = torch.load(dump / f"after-{step}.pt")
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=lambda e: f"step {step} {k}: {e}")
