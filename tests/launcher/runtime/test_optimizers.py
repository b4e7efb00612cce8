"""Every torch.optim optimizer that keeps per-parameter state, in live mode, in one process (no workers):

  * the manifests the planner prices (migrate.manifest.plan_manifest over the meta device, the state learnt
    from the optimizer itself: migrate.optim_state) name exactly the tensors a real optimizer holds after real
    steps, with their shapes and dtypes;
  * the runtime's fresh optimizer (launcher.runtime.build.Builder: state created by a step on zero gradients)
    steps exactly like plain torch's, and its state survives a layout change bit for bit: trained as two
    pipeline stages, exported (export_local), assembled into one stage (what a migration's receiver does),
    split into two again, each time trained on and compared with one plain-PyTorch model trained alike.

The classes are enumerated from torch.optim, so one torch adds is tested (or must be skipped here, with its
reason). The optimizer's settings are the defaults but where the default keeps no state (SGD's momentum 0)
or leaves state out (RMSprop's momentum and centered); fused and foreach implementations run the same
tests (VARIANTS)."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from launcher.runtime.build import Builder
from launcher.runtime.layout import keep_stage_blocks, parse_layout
from launcher.runtime.state import export_local, state_views
from migrate.manifest import ManifestError, meta_module, module_manifest, plan_manifest

#: optimizers live mode cannot run, and why
SKIPPED = {"LBFGS": "a closure optimizer: its step evaluates the model again, a step boundary has no closure",
           "SparseAdam": "needs sparse gradients (nn.Embedding(sparse=True)), and its `step` is an int, not a tensor"}
SETTINGS = {"SGD": {"momentum": 0.9}, "RMSprop": {"momentum": 0.9, "centered": True}}
CLASSES = sorted((c for c in vars(torch.optim).values() if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer)
                  and c is not torch.optim.Optimizer), key=lambda c: c.__name__)


#: fused and foreach implementations (torch's default on CPU is neither): the same state, other kernels
VARIANTS = [(torch.optim.Adam, {"fused": True}), (torch.optim.AdamW, {"foreach": True}),
            (torch.optim.SGD, {"fused": True}), (torch.optim.Adagrad, {"fused": True}),
            (torch.optim.RMSprop, {"foreach": True})]


def _factory(cls, variant: dict | None = None):
    return lambda params: cls(params, lr=0.01, **SETTINGS.get(cls.__name__, {}), **(variant or {}))


class Stack(nn.Module):
    """Four linear blocks (without biases for Muon, which takes matrices only)."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4, bias=bias), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _stage_builder(cls):
    def build(layout) -> Stack:
        m = Stack(bias=cls.__name__ != "Muon")
        keep_stage_blocks(m.blocks, layout)
        return m
    return build


def _step(modules, opts, step: int) -> None:
    """One training step of the modules in a row (a pipeline's stages, or one whole model)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(3, 4, generator=g)
    for o in opts:
        o.zero_grad()
    for m in modules:
        x = m(x)
    (x - 1).pow(2).mean().backward()
    for o in opts:
        o.step()


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.fixture(params=[(c, {}) for c in CLASSES] + VARIANTS,
                ids=lambda case: "-".join([case[0].__name__, *case[1]]))
def optimizer(request):
    """(class, fused/foreach setting): each class of torch.optim, then VARIANTS."""
    if request.param[0].__name__ in SKIPPED:
        pytest.skip(SKIPPED[request.param[0].__name__])
    return request.param


def test_every_optimizer_with_state_is_covered() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD",
            "Rprop"} <= names
    assert set(SKIPPED) <= names


def test_the_planned_manifest_names_the_state_a_real_optimizer_holds(optimizer) -> None:
    build, factory = _stage_builder(optimizer[0]), _factory(*optimizer)
    lay = parse_layout("pp1", 0, 1)
    model = build(lay)
    opt = factory(model.parameters())
    for s in range(2):
        _step([model], [opt], s)
    real = module_manifest(model, opt).by_fqn()
    planned = plan_manifest(meta_module(build, lay), None, 1, 0, factory).by_fqn()
    assert planned == real
    assert any(k.startswith("optim.state.") for k in planned)


def test_state_moves_bit_exact_through_pipeline_splits(optimizer) -> None:
    build, factory = _stage_builder(optimizer[0]), _factory(*optimizer)
    builder = Builder(build, None, factory)
    ref = Stack(bias=optimizer[0].__name__ != "Muon")
    ref_opt = factory(ref.parameters())  # plain torch: state created by its first real step
    pp2 = [builder.build(parse_layout("pp2", r, 2)) for r in range(2)]  # the runtime's fresh optimizers
    step = 0
    for parts, layout in ((pp2, "pp2"), (None, "pp1"), (None, "pp2")):
        if parts is None:  # a migration: every piece exported, the new layout built from what it receives
            sent = {k: v.clone() for m, o in held for k, v in export_local(m, o).items()}
            mine = [{e.fqn: sent[e.fqn] for e in m.entries} for m in builder.manifests(f"{layout}tp1dp1")]
            parts = [builder.build(parse_layout(layout, r, len(mine)), mine[r]) for r in range(len(mine))]
        for _ in range(2):
            step += 1
            _step([m for m, _o in parts], [o for _m, o in parts], step)
            _step([ref], [ref_opt], step)
        got = {k: v for m, o in parts for k, v in state_views(m, o).items()}
        _assert_same(got, state_views(ref, ref_opt))
        for (m, o), manifest in zip(parts, builder.manifests(f"{layout}tp1dp1")):
            assert module_manifest(m, o).by_fqn() == manifest.by_fqn()  # what the planner priced
        held = parts


@pytest.mark.parametrize("name", sorted(SKIPPED))
def test_optimizers_live_mode_cannot_run_are_refused_in_one_line(name: str) -> None:
    builder = Builder(_stage_builder(torch.optim.Adam), None, _factory(getattr(torch.optim, name)))
    with pytest.raises(ManifestError, match=f"^{name}: live mode steps the optimizer to learn its state"):
        builder.manifests("pp1")
