"""First-call costs a worker pays once per process, paid before it joins a migration instead of inside it.

A process's first optimizer step imports torch._dynamo and sets up the optimizer's kernels (about 1.5 s
of CPU, measured on this machine with torch 2.13: 1.48 s for the first Adam step of a fresh process,
0.05 s for the next one on a new model), and its first backward starts the autograd engine. A worker
started by a grow would pay them while rebuilding its trainer on the new layout, inside the pause,
with every other process of the job waiting; with 8 joiners on 2 shared cores that alone is seconds.
A joining worker is started while the old layout still trains, so it pays them there, before it says
it is ready (launcher.runtime.join). No work is hidden: the same calls would otherwise come later.
"""
from __future__ import annotations

from collections.abc import Callable


def first_calls(build_opt: Callable) -> None:
    """One backward and one step of the script's optimizer (`build_opt(params)`) on a throwaway
    parameter. Best effort: a factory that cannot take one plain parameter only skips the warm-up
    (the real step pays it later, as before)."""
    import torch

    p = torch.nn.Parameter(torch.zeros(4))
    (p * 2.0).sum().backward()
    try:
        opt = build_opt([p])
        opt.step()
        opt.zero_grad(set_to_none=True)
    except Exception:  # noqa: BLE001 -- only a warm-up
        return
