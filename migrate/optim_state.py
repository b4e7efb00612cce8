"""Any torch optimizer's per-parameter state, read from the optimizer itself instead of a table of known ones.

Why: a migration and the planner must know every tensor an optimizer keeps per parameter (its key, global
shape, dtype) for layouts no process holds yet, and a fixed table (Adam, AdamW, SGD) refused every other
optimizer, and even described SGD with momentum wrongly (no momentum_buffer). torch optimizers create their
state lazily, inside the first `step()`; what they create depends on the class and its settings (RMSprop's
`centered` adds `grad_avg`, SGD's momentum a buffer, Adafactor factors a matrix's second moment into a row
and a column). So the script's own factory is given zero-size probe parameters (the parameters' dtypes and
ranks, no memory) with zero-size gradients and stepped once: each state tensor then has size 0 along the
dimensions that follow the parameter and its own size along the others (1 for Adafactor's factored
dimension; a scalar such as `step` has shape ()). The meta device was tried first: fused optimizers refuse
meta parameters in their constructor and ASGD/Adafactor call `.item()` in their step, while zero-size CPU
probes work for every torch.optim class but the two that cannot step on dense gradients without a closure
(SparseAdam, LBFGS), which are refused here with torch's own reason.

`record_creation` is the other half: it captures each state tensor as the optimizer creates it, before the
step's update changes it. The runtime creates a fresh optimizer's state with a step on zero gradients (so
the state exists to be moved or checkpointed before the first real step) and then puts that creation value
back: zeroing the state instead was right for Adam only (Rprop's `step_size` starts at lr, ASGD's `eta` at
lr and `mu` at 1, NAdam's `mu_product` at 1, Adagrad's `sum` at initial_accumulator_value).
"""
from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator


class StateError(ValueError):
    """An optimizer whose per-parameter state live mode cannot describe or move."""


class _Recording(dict):
    """A parameter's state dict that keeps a copy of each value as first assigned (its creation)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.created: dict = {}

    def __setitem__(self, key, value) -> None:
        if key not in self.created and key not in self:
            self.created[key] = value.detach().clone() if hasattr(value, "detach") else value
        super().__setitem__(key, value)


@contextlib.contextmanager
def record_creation(opt) -> Iterator[dict]:
    """Within the block, the state `opt` creates is recorded as created: yields {param: {key: value}}, filled
    when the block ends, of the values as they were before any update changed them (state the optimizer
    made in its constructor, Adagrad's, is taken as it was on entry). `opt.state` holds plain dicts again
    after the block."""
    created: dict = {}
    before = {p: {k: v.detach().clone() if hasattr(v, "detach") else v for k, v in st.items()}
              for p, st in opt.state.items()}
    opt.state = defaultdict(_Recording, {p: _Recording(st) for p, st in opt.state.items()})
    try:
        yield created
    finally:
        for p, st in opt.state.items():
            created[p] = {**getattr(st, "created", {}), **before.get(p, {})}
        opt.state = defaultdict(dict, {p: dict(st) for p, st in opt.state.items()})


def reset_to_created(opt, created: dict) -> None:
    """Put every state tensor of `opt` back to its creation value (record_creation), in place."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    for p, st in opt.state.items():
        for key, value in st.items():
            first = created.get(p, {}).get(key)
            if hasattr(value, "copy_") and first is not None:
                local(value).copy_(local(first))


def state_shapes(named_params: list[tuple[str, object]], build_opt: Callable) -> dict[str, dict[str, tuple]]:
    """{parameter name: {state key: (global shape, dtype name)}} of the optimizer `build_opt(params)` makes
    over the parameters `named_params` (any device, the meta one too; only their rank, dtype and
    requires_grad are used): see the module docstring. StateError for state that is not a tensor or whose
    shape does not follow the parameter's, or an optimizer that cannot step on the probes."""
    import torch

    probes = [torch.nn.Parameter(torch.empty((0,) * p.dim(), dtype=p.dtype), requires_grad=p.requires_grad)
              for _n, p in named_params]
    for probe in probes:
        if probe.requires_grad:
            probe.grad = torch.zeros_like(probe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = build_opt(iter(probes))
        _step_each_group(opt)
    out: dict[str, dict[str, tuple]] = {}
    for (name, p), probe in zip(named_params, probes):
        out[name] = {key: _global_shape(type(opt).__name__, name, key, tuple(p.shape), v)
                     for key, v in sorted(opt.state.get(probe, {}).items())}
    return out


def _step_each_group(opt) -> None:
    """One step per parameter group on its own: an optimizer whose update fails on zero-size probes after
    it created its state (Adafactor and Muon divide by a size of 0) still creates every group's state.
    A step that fails before creating any state is the optimizer refusing the probes: StateError."""
    groups = opt.param_groups
    try:
        for group in groups:
            opt.param_groups = [group]
            try:
                opt.step()
            except Exception as exc:  # noqa: BLE001 -- judged by what the step created
                if not any(p in opt.state and opt.state[p] for p in group["params"] if p.grad is not None) and \
                        any(p.grad is not None for p in group["params"]):
                    raise StateError(f"{type(opt).__name__}: live mode steps the optimizer to learn its state, and "
                                     f"it failed: {type(exc).__name__}: {exc}") from None
    finally:
        opt.param_groups = groups


def _global_shape(kind: str, name: str, key: str, shape: tuple[int, ...], value) -> tuple:
    """(global shape, dtype name) of state `key` of parameter `name` (of `shape`), from its probe's `value`."""
    if not hasattr(value, "shape"):
        raise StateError(f"{kind}: state {key!r} of {name} is a {type(value).__name__}, not a tensor: live mode "
                         "moves tensor state only")
    probe = tuple(value.shape)
    if len(probe) == len(shape):
        got = tuple(s if n == 0 else n for s, n in zip(shape, probe))
    elif 0 not in probe:
        got = probe  # a shape of its own (a scalar such as `step`)
    else:
        raise StateError(f"{kind}: state {key!r} of {name} has {len(probe)} dimensions for a parameter of "
                         f"{len(shape)}: live mode cannot tell how it follows the parameter")
    return got, str(value.dtype).replace("torch.", "")
