"""migrate.warmup: the first-call warm-up a worker runs before it says it is ready (launcher.runtime.join)
steps the script's own optimizer once, and is only ever a warm-up: a factory that cannot take one plain
parameter does not stop the worker."""
from __future__ import annotations

import torch

from migrate.warmup import first_calls


def test_the_scripts_optimizer_is_built_and_stepped_once() -> None:
    made = []

    def build(params):
        opt = torch.optim.Adam(params, lr=1e-3)
        made.append(opt)
        return opt

    first_calls(build)
    assert len(made) == 1
    (p,) = made[0].param_groups[0]["params"]
    assert made[0].state[p]["step"].item() == 1 and p.grad is None  # stepped, then zero_grad(set_to_none)


def test_a_factory_that_refuses_a_plain_parameter_only_skips_the_warm_up() -> None:
    def build(params):
        raise TypeError("wants named parameter groups")

    first_calls(build)  # no exception
