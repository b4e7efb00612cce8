"""Which parallel layout to run on the devices a job holds: a pure function, no processes.

`choose_layout(devices, gpus_per_node, layouts, model)` returns the layout to use when the job
holds `devices` devices. With a `layouts` list (the user's `--layouts`, in order of
preference) it takes the valid listed layout that uses the most devices, ties going to the
earlier entry. Without a list it searches every PP x TP x DP grid. A layout is valid when it
fits the devices, every TP group fits inside one node, layers % pp == 0, and heads, ffn and
vocab divide by tp.

`gpus_per_node` is one count (all nodes alike: tp must divide it) or the GPU count of each
node held (uneven nodes, e.g. (4, 4, 2, 2)): then a TP group may use any tp GPUs of a node,
and the nodes must seat pp * dp groups, sum(size // tp) >= pp * dp. A TP group never spans
nodes; when nothing fits without spanning, the error says so.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from migrate.layout import LayoutError, ModelSpec, ParallelConfig


class NoLayoutError(LayoutError):
    """No layout fits the devices: the message says what was tried."""


def _tp_room(cfg: ParallelConfig, gpus_per_node: int | Sequence[int]) -> str | None:
    """None when the TP groups of `cfg` fit inside nodes, else why not."""
    if isinstance(gpus_per_node, int):
        if gpus_per_node % cfg.tp:
            return f"{cfg}: tp={cfg.tp} does not fit inside a {gpus_per_node}-GPU node"
        return None
    sizes = list(gpus_per_node)
    if cfg.tp > max(sizes, default=0):
        return f"{cfg}: tp={cfg.tp} does not fit inside any node (the largest has {max(sizes, default=0)} GPUs)"
    groups = sum(s // cfg.tp for s in sizes)
    if groups < cfg.groups * cfg.dp:
        return (f"{cfg}: nodes of {','.join(map(str, sizes))} GPUs seat only {groups} TP groups of {cfg.tp} "
                f"inside a node, {cfg.groups * cfg.dp} needed")
    return None


def why_invalid(cfg: ParallelConfig, devices: int, gpus_per_node: int | Sequence[int],
                model: ModelSpec | None) -> str | None:
    """None when `cfg` can run on `devices` devices, else the reason in words."""
    if cfg.world_size > devices:
        return f"{cfg} needs {cfg.world_size} devices, only {devices} left"
    room = _tp_room(cfg, gpus_per_node)
    if room:
        return room
    if model is not None:
        try:
            model.check_config(cfg)
        except LayoutError as exc:
            return str(exc)
    return None


def _first_candidate(devices: int, gpus_per_node: int | Sequence[int], model: ModelSpec | None
                     ) -> ParallelConfig | None:
    """The preferred valid layout on at most `devices` devices -- most devices, then less PP, then more
    TP -- found by walking that order and stopping at the first valid one. Listing every PP x TP x DP
    grid and sorting grew with devices^2 (the up-front check of every node count of `elastic-launch
    --nnodes 1:4096 --gpus-per-node 8` did not finish in 60 s); this usually stops at the first world size."""
    largest = gpus_per_node if isinstance(gpus_per_node, int) else max(gpus_per_node, default=0)
    for world in range(devices, 0, -1):
        for pp in (p for p in range(1, world + 1) if world % p == 0):
            rest = world // pp
            for tp in (t for t in range(min(largest, rest), 0, -1) if rest % t == 0):
                cfg = ParallelConfig(pp=pp, tp=tp, dp=rest // tp)
                if why_invalid(cfg, devices, gpus_per_node, model) is None:
                    return cfg
    return None


def _nodes_text(gpus_per_node: int | Sequence[int]) -> str:
    if isinstance(gpus_per_node, int):
        return f"{gpus_per_node} GPUs per node"
    return f"nodes of {','.join(map(str, gpus_per_node))} GPUs"


def choose_layout(devices: int, gpus_per_node: int | Sequence[int], layouts: Sequence[ParallelConfig] = (),
                  model: ModelSpec | None = None) -> ParallelConfig:
    """The layout to run on `devices` devices (see the module docstring); NoLayoutError if none."""
    if devices < 1:
        raise NoLayoutError("no devices left to run on")
    if layouts:
        valid = [c for c in layouts if why_invalid(c, devices, gpus_per_node, model) is None]
        if not valid:
            reasons = "; ".join(why_invalid(c, devices, gpus_per_node, model) or "" for c in layouts)
            spanning = "" if isinstance(gpus_per_node, int) else " without a TP group spanning nodes"
            raise NoLayoutError(f"none of the layouts fits {devices} devices{spanning} ({reasons})")
        return max(valid, key=lambda c: (c.world_size, -list(layouts).index(c)))
    found = _first_candidate(devices, gpus_per_node, model)
    if found is None:
        raise NoLayoutError(f"no PP x TP x DP layout fits {devices} devices with {_nodes_text(gpus_per_node)} "
                            "without a TP group spanning nodes")
    return found


def idle_note(devices: int, gpus_per_node: int | Sequence[int], layouts: Sequence[ParallelConfig],
              model: ModelSpec | None, chosen: ParallelConfig) -> str | None:
    """Why `chosen` leaves devices idle, in one line (None when it uses them all): the listed layouts that
    would use more, each with why it cannot run -- a layout dropped is said, not left to a GPU count."""
    idle = devices - chosen.world_size
    if idle <= 0:
        return None
    bigger = [c for c in layouts if chosen.world_size < c.world_size <= devices]
    reasons = [why_invalid(c, devices, gpus_per_node, model) or f"{c}: not preferred" for c in bigger]
    why = "; ".join(reasons) if reasons else ("no layout in --layouts uses more" if layouts else
                                             "no layout the model takes uses more")
    return f"{chosen} uses {chosen.world_size} of the {devices} devices, {idle} idle ({why})"


def tp_fit(node_gpus: Sequence[int]) -> int:
    """What a TP group's size must divide to fit inside every one of these nodes: the greatest common
    divisor of their GPU counts (the count itself when all nodes are alike; 2 for 4,4,2,2)."""
    return math.gcd(*node_gpus)


def check_node_range(min_nodes: int, max_nodes: int, gpus_per_node: int, layouts: Sequence[ParallelConfig],
                     model: ModelSpec | None = None, node_gpus: Sequence[int] = ()) -> None:
    """Every node count in [min_nodes, max_nodes] must have a layout (NoLayoutError otherwise).
    Uneven nodes (`node_gpus`, local backend): n nodes are the first n, TP fits every node."""
    for n in range(min_nodes, max_nodes + 1):
        devices = sum(node_gpus[:n]) if node_gpus else n * gpus_per_node
        fit = tp_fit(node_gpus) if node_gpus else gpus_per_node
        try:
            choose_layout(devices, fit, layouts, model)
        except NoLayoutError as exc:
            shape = f"GPUs {','.join(map(str, node_gpus[:n]))}" if node_gpus else f"x {gpus_per_node} GPUs"
            raise NoLayoutError(f"with {n} node(s) {shape}: {exc}") from None
