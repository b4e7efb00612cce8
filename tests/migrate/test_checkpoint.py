"""Suspend/resume checkpoints: written once per piece of state, read back on any layout, exact next step."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from migrate.checkpoint import checkpoint_step, load_checkpoint, save_checkpoint
from migrate.layout import ModelSpec, ParallelConfig
from migrate.localrun import Scenario, free_port, load_state, run_scenario
from migrate.state import initial_state
from migrate.train import Groups, TrainConfig, Trainer
from tests.migrate.fullstate import assemble
from tests.migrate.spawned import context

MODEL = ModelSpec(layers=4, hidden=64, heads=4, vocab=128, seq_len=16)
TC = TrainConfig(global_batch=4, micro_batch=1, seq_len=16)
P = ParallelConfig.parse


def _worker(rank: int, cfg: ParallelConfig, port: int, path: str, mode: str, world_rank: list[int], q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.world_size)
    me = world_rank.index(rank)
    if mode.startswith("save"):
        t = Trainer(MODEL, cfg, me, initial_state(MODEL, cfg, me, 0), world_rank, Groups(cfg, world_rank, me), TC)
        losses = [t.train_step() for _ in range(2)]
        state = t.export_state()
        save_checkpoint(MODEL, cfg, state, path, world_rank)
    else:
        state = load_checkpoint(MODEL, cfg, me, path, world_rank)
        buf = io.BytesIO()
        torch.save({"tensors": state.tensors, "step": state.step}, buf)  # before training changes it in place
        t = Trainer(MODEL, cfg, me, state, world_rank, Groups(cfg, world_rank, me), TC)
        losses = [t.train_step() for _ in range(2)]
    if mode.startswith("save"):
        buf = io.BytesIO()
        torch.save({"tensors": state.tensors, "step": state.step}, buf)
    q.put((rank, losses, buf.getvalue()))
    dist.barrier()  # DCP users must not tear down before everyone is done
    dist.destroy_process_group()


def _run(cfg: ParallelConfig, path: Path, mode: str, world_rank: list[int]):
    q = context().Queue()
    ctx_ = mp.start_processes(_worker, args=(cfg, free_port(), str(path), mode, world_rank, q),
                              nprocs=cfg.world_size, start_method="forkserver", join=False)
    out = [q.get(timeout=120) for _ in range(cfg.world_size)]  # drain before joining: big reports block exit
    while not ctx_.join(timeout=60):
        pass
    losses = [l for r, l, _ in sorted(out) if l[0] is not None][0]
    states = {r: load_state(b) for r, _, b in out}
    return losses, assemble(MODEL, cfg, world_rank, states), states


def test_suspend_on_one_layout_resume_on_another(tmp_path):
    reference = run_scenario(Scenario(MODEL, P("pp1"), P("pp1"), TC, steps_before=4, steps_after=0),
                             ctx=context())[0].losses_before
    saved_cfg, resumed_cfg = P("pp2dp2"), P("tp2")
    before, full_before, _ = _run(saved_cfg, tmp_path / "ck", "save", [3, 2, 1, 0])  # world ranks not in rank order
    assert checkpoint_step(tmp_path / "ck") == 2
    # DP replicas and TP-replicated tensors are written once: about one replica of state on disk
    written = sum(f.stat().st_size for f in (tmp_path / "ck").glob("*.distcp"))
    assert MODEL.state_bytes <= written < 1.2 * MODEL.state_bytes
    after, full_after, states = _run(resumed_cfg, tmp_path / "ck", "load", [0, 1])
    for key in full_before:
        assert torch.equal(full_before[key], full_after[key]), key
    assert {s.step for s in states.values()} == {2}
    assert before + after == pytest.approx(reference, rel=1e-5)  # DP and TP changed: same math, same step


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(MODEL, P("pp1"), 0, tmp_path / "nothing")
    assert checkpoint_step(tmp_path / "nothing") is None
