"""launcher.runtime.state.rebind/unbind and OptimizerSettings: the optimizer object a script and its LR scheduler
hold takes a new layout's parameters and state while its settings carry on, so a scheduler made on it (a chained
one too) steps the same lr as in a run that never moved. In one process, no workers."""
from __future__ import annotations

import copy

import torch
from torch.optim.lr_scheduler import ChainedScheduler, ExponentialLR, LambdaLR, StepLR

from launcher.runtime.state import OptimizerSettings, rebind, unbind


def _opt(params):
    return torch.optim.AdamW(params, lr=0.1, betas=(0.8, 0.9), weight_decay=0.01)


def _sched(opt):
    return ChainedScheduler([LambdaLR(opt, lambda s: 1 / (1 + s)), ExponentialLR(opt, gamma=0.9),
                             StepLR(opt, step_size=2, gamma=0.5)])


def _steps(opt, sched, n):
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        for p in (p for g in opt.param_groups for p in g["params"]):
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return lrs


def test_a_scheduler_on_the_script_s_optimizer_goes_on_after_it_is_rebound_to_new_parameters() -> None:
    ref_opt = _opt([torch.nn.Parameter(torch.zeros(3))])
    ref = _steps(ref_opt, _sched(ref_opt), 8)
    opt = _opt([torch.nn.Parameter(torch.zeros(1))])  # the runtime's placeholder until a layout is entered
    sched = _sched(opt)
    rebind(opt, _opt([torch.nn.Parameter(torch.zeros(3))]))
    got = _steps(opt, sched, 4)
    settings = copy.deepcopy(OptimizerSettings(opt).state_dict())
    unbind(opt)  # a migration: the old layout's parameters and state are let go
    assert opt.param_groups[0]["params"] == [] and not opt.state
    fresh = _opt([torch.nn.Parameter(torch.zeros(3))])
    OptimizerSettings(opt).load_state_dict(settings)
    rebind(opt, fresh)
    assert opt.state is fresh.state and opt.param_groups[0]["params"] == fresh.param_groups[0]["params"]
    got += _steps(opt, sched, 4)
    assert got == ref
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["weight_decay"] == 0.01


def test_a_worker_that_joins_later_takes_the_settings_and_the_scheduler_state_it_is_handed() -> None:
    ref_opt = _opt([torch.nn.Parameter(torch.zeros(2))])
    ref_sched = _sched(ref_opt)
    ref = _steps(ref_opt, ref_sched, 10)
    old = _opt([torch.nn.Parameter(torch.zeros(2))])
    old_sched = _sched(old)
    got = _steps(old, old_sched, 5)
    handed = copy.deepcopy((OptimizerSettings(old).state_dict(), old_sched.state_dict()))
    joiner = _opt([torch.nn.Parameter(torch.zeros(1))])  # its placeholder, its scheduler made at join
    sched = _sched(joiner)
    OptimizerSettings(joiner).load_state_dict(handed[0])
    sched.load_state_dict(handed[1])
    rebind(joiner, _opt([torch.nn.Parameter(torch.zeros(2))]))
    got += _steps(joiner, sched, 5)
    assert got == ref
