"""launcher.runtime.state.on_meta and assemble: a migration's model is built on the meta device and takes the
received tensors themselves (no copy, no optimizer step inside the pause), only where every tensor it holds
is in its state dict under one name (a load then fills all of it); otherwise the runtime builds it for real.
Plain modules and a real torch.optim.Adam, no processes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from launcher.runtime.state import assemble, on_meta, state_views

LAY = SimpleNamespace(tp=1, fsdp=1)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm = nn.Linear(4, 8), nn.LayerNorm(8)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        return self.norm(self.up(x)).sum()


class WithAttribute(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.freqs = torch.arange(4.0)  # a plain tensor attribute: no load would fill it


class WithScratchBuffer(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(4), persistent=False)


class Tied(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(8, 4, bias=False)
        self.down.weight = self.up.weight  # one tensor under two names  # type: ignore[assignment]


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


def _trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = Plain()
    opt = _adam(m.parameters())
    for i in range(steps):
        opt.zero_grad()
        m(torch.full((2, 4), float(i))).backward()
        opt.step()
    return m, opt


def test_a_migration_model_holds_the_received_tensors_themselves_and_trains_on_bit_exact() -> None:
    ref, ref_opt = _trained(3)
    received = {k: v.detach().clone() for k, v in state_views(ref, ref_opt).items()}  # what a transfer delivers
    module = on_meta(lambda lay: Plain(), LAY, {})
    assert module is not None and {t.device.type for t in module.state_dict().values()} == {"meta"}
    m, opt = assemble(module, _adam, received)
    mine = state_views(m, opt)
    assert set(mine) == set(received)
    for k, t in mine.items():  # no copy: the very tensors
        assert t.data_ptr() == received[k].data_ptr(), k
    assert all(p.requires_grad for p in m.parameters())
    for model, o in ((ref, ref_opt), (m, opt)):  # one more step each: the same numbers
        o.zero_grad()
        model(torch.full((2, 4), 3.0)).backward()
        o.step()
    for k, v in state_views(ref, ref_opt).items():
        assert torch.equal(v, mine[k]), k


def test_tensors_a_load_would_not_fill_make_the_runtime_build_for_real() -> None:
    assert on_meta(lambda lay: WithAttribute(), LAY, {}) is None
    assert on_meta(lambda lay: WithScratchBuffer(), LAY, {}) is None


def test_tied_weights_make_the_runtime_build_for_real() -> None:
    assert on_meta(lambda lay: Tied(), LAY, {}) is None


def test_a_tp_plan_to_apply_makes_the_runtime_build_for_real() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    assert on_meta(lambda lay: Plain(), SimpleNamespace(tp=2, fsdp=1), {"up": ColwiseParallel()}) is None
    assert on_meta(lambda lay: Plain(), SimpleNamespace(tp=1, fsdp=2), {}) is None  # FSDP2: DTensors too


def test_a_missing_received_tensor_fails_before_training() -> None:
    ref, ref_opt = _trained(1)
    received = {k: v.detach().clone() for k, v in state_views(ref, ref_opt).items() if k != "up.weight"}
    module = on_meta(lambda lay: Plain(), LAY, {})
    with pytest.raises(KeyError, match="up.weight"):
        assemble(module, _adam, received)
