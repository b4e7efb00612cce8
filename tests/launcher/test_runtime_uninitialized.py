"""launcher.runtime._uninitialized: a model whose state a migration overwrites is built without its initial
values only where every tensor it holds is in its state dict (a load then fills all of it); otherwise the
runtime builds it for real. Plain modules, no processes."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from launcher.runtime import _uninitialized

LAY = SimpleNamespace(tp=1)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm = nn.Linear(4, 8), nn.LayerNorm(8)
        self.register_buffer("count", torch.zeros(1))


class WithAttribute(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.freqs = torch.arange(4.0)  # a plain tensor attribute: no load would fill it


class WithScratchBuffer(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(4), persistent=False)


def test_a_model_whose_state_dict_holds_every_tensor_is_built_empty_on_the_cpu() -> None:
    m = _uninitialized(lambda lay: Plain(), LAY, {})
    assert m is not None
    assert {t.device.type for t in m.state_dict().values()} == {"cpu"}
    assert set(m.state_dict()) == set(Plain().state_dict())
    m.load_state_dict(Plain().state_dict())  # what a migration's load does: every entry filled


def test_tensors_a_load_would_not_fill_make_the_runtime_build_for_real() -> None:
    assert _uninitialized(lambda lay: WithAttribute(), LAY, {}) is None
    assert _uninitialized(lambda lay: WithScratchBuffer(), LAY, {}) is None


def test_a_tp_plan_to_apply_makes_the_runtime_build_for_real() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    assert _uninitialized(lambda lay: Plain(), SimpleNamespace(tp=2), {"up": ColwiseParallel()}) is None
