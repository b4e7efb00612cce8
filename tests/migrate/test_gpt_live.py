"""The reference GPT as one producer of state manifests for the runtime API (migrate.gpt_live), single process.

Oracles: the manifest a layout's rule says (stage_manifest) against what the built stage and its Adam
really hold (migrate.manifest.module_manifest reads the tensors); and the builder's first steps against
the reference trainer's (migrate.train.Trainer), which starts from the same seeded weights."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from migrate.gpt_live import build_stage, stage_manifest
from migrate.layout import ModelSpec, ParallelConfig
from migrate.manifest import meta_module, module_manifest

MODEL = ModelSpec(layers=4, hidden=64, heads=2, vocab=128, seq_len=8)


def _layout(name: str, rank: int):
    cfg = ParallelConfig.parse(name)
    return types.SimpleNamespace(name=str(cfg), rank=rank, mesh=None)


def _adam(stage):
    opt = torch.optim.Adam(stage.parameters(), lr=1e-3, fused=True)
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the optimizer state exists, as the runtime creates it
    return opt


@pytest.mark.parametrize("layout", ["pp1tp1", "pp1tp2dp2", "pp2tp2", "pp4tp1dp2"])
def test_the_manifest_says_what_each_rank_holds(layout: str) -> None:
    cfg = ParallelConfig.parse(layout)
    for rank in range(cfg.world_size):
        stage = build_stage(MODEL, _layout(layout, rank))
        held = {e.fqn: (e.local_shape, e.dtype) for e in module_manifest(stage, _adam(stage)).entries}
        said = {e.fqn: (e.local_shape, e.dtype) for e in stage_manifest(MODEL, cfg, rank).entries}
        assert held == said, (layout, rank, set(held) ^ set(said))
        meta = meta_module(build_stage, MODEL, _layout(layout, rank))
        assert all(p.device.type == "meta" for p in meta.parameters())


def test_the_builder_starts_from_the_reference_weights_and_trains_like_it() -> None:
    from migrate.state import initial_state
    from migrate.train import Groups, TrainConfig, Trainer, batch

    cfg, tc = ParallelConfig.parse("pp1"), TrainConfig(global_batch=2, seq_len=MODEL.seq_len)
    ref = Trainer(MODEL, cfg, 0, initial_state(MODEL, cfg, 0, 0), [0], Groups(cfg, [0], 0), tc)
    want = [ref.train_step() for _ in range(2)]
    stage = build_stage(MODEL, _layout("pp1", 0))
    opt = torch.optim.Adam(stage.parameters(), lr=tc.lr, fused=True)
    got = []
    for step in range(2):
        losses = [F.cross_entropy(stage(mb[:, :-1]).reshape(-1, MODEL.vocab), mb[:, 1:].reshape(-1),
                                  reduction="sum") / (tc.global_batch * tc.seq_len)
                  for mb in batch(MODEL, tc, step).split(tc.micro_batch)]
        for loss in reversed(losses):  # the reference's order: every forward, then backward from the last
            loss.backward()
        loss_sum = torch.zeros(())
        for loss in losses:
            loss_sum = loss_sum + loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        got.append(float(loss_sum))
    assert got == want


def test_mixed_precision_is_one_line() -> None:
    with pytest.raises(ValueError, match="fp32 only"):
        stage_manifest(ModelSpec(layers=2, hidden=64, heads=2, vocab=128, dtype="bf16"), ParallelConfig(), 0)
