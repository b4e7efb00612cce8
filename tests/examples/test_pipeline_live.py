"""examples/pipeline_live.py under `elastic-launch --backend local` in LIVE mode with PIPELINE parallelism:
pp2dp2 on 2 nodes x 2 devices, shrunk to 1 node (pp1dp2: the two stages merge) and grown back (pp2dp2),
with `elastic resize`. Oracle: one process trains the same model on the same steps with plain PyTorch
(no launcher.runtime, no torch.distributed): the same DP shares and microbatches, gradients summed
in microbatch order and divided as GPipe and the DP mean do. The whole state the script gathers after
every step, and every logged loss, equal the oracle's bit for bit; every step runs exactly once; each
migration moves exactly the bytes each new rank's stage needs and its device did not hold."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

from db import Store
from tests.examples.harness import ROOT, shrink_and_grow

STEPS, BATCH, MICRO, DP = 40, 8, 2, 2


def _example():
    spec = importlib.util.spec_from_file_location("pipeline_live_example", ROOT / "examples" / "pipeline_live.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _oracle(ex) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """State after each step and DP rank 0's loss of each step, trained in one process on one thread
    (the workers get OMP_NUM_THREADS=1, torchrun's default; LayerNorm's weight gradient sums in another
    order on two threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(ex)
    finally:
        torch.set_num_threads(threads)


def _train(ex) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    model = ex.Stack()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    states, losses = [], []
    for step in range(1, STEPS + 1):
        grads = []
        for d in range(DP):
            model.zero_grad(set_to_none=True)
            x, y = ex.batch(step, BATCH, d, DP)
            mb = []
            for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):  # GPipe: forward+backward per microbatch, in order
                loss = nn.functional.mse_loss(model(xm), ym)
                loss.backward()
                mb.append(loss.detach())
            grads.append([p.grad / MICRO for p in model.parameters()])
            if d == 0:
                losses.append(torch.stack(mb).mean().item())
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = (gs[0] + gs[1]) / DP
        opt.step()
        names = {id(p): n for n, p in model.named_parameters()}
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for p, st in opt.state.items():
            state.update({f"optim.state.{names[id(p)]}.{k}": v.detach().clone() for k, v in st.items()})
        states.append(state)
    return states, losses


def test_pipeline_stages_change_live_bit_exact_on_shrink_and_grow(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    dump.mkdir()
    rows = shrink_and_grow(tmp_path, "pipe", "pp2dp2,pp1dp2", "pp1tp1dp2", "pipeline_live.py",
                           ["--steps", str(STEPS), "--global-batch", str(BATCH), "--microbatches", str(MICRO),
                            "--dump-dir", str(dump), "--step-sleep", "0.2"])
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)), rows  # every step once, none lost or repeated
    assert [r[2] for r in rows] == [BATCH * s for s in range(1, STEPS + 1)]  # the data position travelled
    layouts = [r[1] for r in rows]
    assert layouts[0] == "pp2tp1dp2" and "pp1tp1dp2" in layouts and layouts[-1] == "pp2tp1dp2"
    assert sum(a != b for a, b in zip(layouts, layouts[1:])) == 2

    states, losses = _oracle(_example())
    assert [r[3] for r in rows] == losses  # the loss goes on exactly as in one process
    for step, want in enumerate(states, start=1):
        got = torch.load(dump / f"after-{step}.pt")
        assert got.keys() == want.keys(), (step, sorted(got.keys() ^ want.keys()))
        for k in want:
            assert torch.equal(got[k], want[k]), (step, k)

    store = Store(f"sqlite:///{tmp_path}/e.db")
    job = store.find_job("pipe")
    assert (job.state, job.mode) == ("finished", "live")
    maps = store.rank_maps(job.id)
    assert [m.layout for m in maps] == ["pp1tp1dp4", "pp2tp1dp2", "pp1tp1dp2", "pp2tp1dp2"]
    migs = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    assert [(m.kind, m.status, m.from_layout, m.to_layout) for m in migs] == [
        ("live", "succeeded", "pp2tp1dp2", "pp1tp1dp2"), ("live", "succeeded", "pp1tp1dp2", "pp2tp1dp2")]
    # only what changes owner moves: each new rank receives exactly the tensors its stage needs that its
    # device did not hold before (by the recorded rank maps), counted from the oracle's tensors
    size = {k: t.numel() * t.element_size() for k, t in states[0].items()}
    want = []
    for before, after in zip(maps[1:], maps[2:]):
        held = {(e.node, e.gpu): _names(before.layout, e.pp, size) for e in before.entries}
        want.append(sum(size[k] for e in after.entries
                        for k in _names(after.layout, e.pp, size) - held.get((e.node, e.gpu), set())))
    assert [m.bytes_moved for m in migs] == want and all(want)


#: the tensors (by name prefix) of each stage when 4 blocks are split into 2 stages
STAGES = {0: ("embed.", "blocks.0.", "blocks.1."), 1: ("blocks.2.", "blocks.3.", "head.")}


def _names(layout: str, pp_rank: int, size: dict) -> set[str]:
    """Names (model and optimizer state) that pipeline stage `pp_rank` of `layout` holds."""
    if layout.startswith("pp1"):
        return set(size)
    return {k for k in size if k.removeprefix("optim.state.").startswith(STAGES[pp_rank])}
