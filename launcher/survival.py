"""What a running layout survives: the loss of any one process, the loss of any one node (pure).

A failure is covered when every (pp, tp) slice of the state keeps a holder outside what was lost:
then the job re-plans from the surviving DP replicas. What is not covered costs the steps since
the last safety checkpoint (launcher.transaction restore), or the job when there is none.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# safety checkpoint interval (steps) when a layout the job may run cannot survive a node loss
DEFAULT_CHECKPOINT_EVERY = 100


@dataclass(frozen=True)
class Survival:
    """Whether the loss of any one process / any one node leaves a full replica of the state."""

    process: bool
    node: bool

    def describe(self) -> str:
        say = {True: "survives", False: "does not survive"}
        return f"{say[self.process]} the loss of any one process, {say[self.node]} the loss of any one node"

    def as_dict(self) -> dict[str, bool]:
        return {"process": self.process, "node": self.node}


def holders(layout, devices: Sequence[int]) -> dict[tuple[int, int], set[int]]:
    """(pp, tp) slice -> the devices that hold it."""
    out: dict[tuple[int, int], set[int]] = {}
    for rank, dev in enumerate(devices):
        pp, _dp, tp = layout.coords(rank)
        out.setdefault((pp, tp), set()).add(dev)
    return out


def survival(layout, devices: Sequence[int], node_of: dict[int, str]) -> Survival:
    """What the layout `layout` placed on `devices` (rank r on devices[r]) survives; `node_of` maps a
    device to its node."""
    slices = holders(layout, devices)
    process = all(len(held) >= 2 for held in slices.values())
    nodes = {node_of[d] for d in devices}
    node = all(any(node_of[d] != lost for d in held) for lost in nodes for held in slices.values())
    return Survival(process, node)


def auto_checkpoint_every(min_nodes: int, max_nodes: int, gpus_per_node: int, layouts, model, placement: str) -> int:
    """The safety checkpoint interval when --checkpoint-every is not given: DEFAULT_CHECKPOINT_EVERY when a
    layout the job may run on some node count of its range cannot survive a node loss, else 0. Resilient
    placement (migrate.allocator) keeps a replica of every stage off each node whenever DP >= 2 and
    there are 2 nodes or more; packed placement keeps ranks in device order."""
    from launcher.policy import choose_layout

    for n in range(min_nodes, max_nodes + 1):
        layout = choose_layout(n * gpus_per_node, gpus_per_node, layouts, model)
        if placement == "resilient":
            survives = layout.dp >= 2 and n >= 2
        else:
            devices = range(layout.world_size)
            survives = survival(layout, devices, {d: f"n{d // gpus_per_node}" for d in devices}).node
        if not survives:
            return DEFAULT_CHECKPOINT_EVERY
    return 0

