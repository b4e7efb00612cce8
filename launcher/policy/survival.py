"""What a running layout survives: the loss of any one process, the loss of any one node (pure).

A failure is covered when every (pp, tp) slice of the state keeps a holder outside what was lost:
then the job re-plans from the surviving DP replicas. What is not covered costs the steps since
the last safety checkpoint (launcher.loop.outcome restore), or the job when there is none.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# safety checkpoint interval (steps) when a layout the job may run cannot survive a node loss
DEFAULT_CHECKPOINT_EVERY = 100
# node choices auto_checkpoint_every checks at most before it answers the safe way (checkpoints on)
MAX_CHOICES = 20_000
#: past this many nodes the node choices are not enumerated (their recursion is as deep as the node count)
#: and the answer is the safe one, a checkpoint
MAX_NODES_CHECKED = 512


@dataclass(frozen=True)
class Survival:
    """Whether the loss of any one process / any one node leaves a full replica of the state."""

    process: bool
    node: bool
    node_note: str = ""  # why a node's loss ends the job whatever the layout (the allocation's own terms)
    batch: bool | None = None  # the node running elastic-launch lost: requeued, resumed from a safety checkpoint

    def describe(self) -> str:
        """One clause a user reads at a glance: what is survived first, then what is not."""
        losses = [("any one process", self.process),
                  ("any one node" + (f" ({self.node_note})" if self.node_note else ""), self.node)]
        losses += [] if self.batch is None else [("the batch node", self.batch)]
        kept, lost = [name for name, ok in losses if ok], [name for name, ok in losses if not ok]
        if not kept:
            return f"does not survive the loss of {_either(lost)}"
        return f"survives the loss of {_and(kept)}" + (f"; not of {_either(lost)}" if lost else "")

    def as_dict(self) -> dict[str, bool | str]:
        return {"process": self.process, "node": self.node, **({"node_note": self.node_note} if self.node_note else {}),
                **({} if self.batch is None else {"batch": self.batch})}


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def holders(layout, devices: Sequence[int]) -> dict[int, set[int]]:
    """class (a (pp, fsdp, tp) slice: migrate.layout.ParallelConfig.class_of) -> the devices that hold it."""
    out: dict[int, set[int]] = {}
    for rank, dev in enumerate(devices):
        out.setdefault(layout.class_of(rank), set()).add(dev)
    return out


def covered(layout, devices: Sequence[int], lost) -> bool:
    """True when every class of `layout` on `devices` keeps a holder outside the devices `lost`."""
    return all(held - set(lost) for held in holders(layout, devices).values())


def survival(layout, devices: Sequence[int], node_of: dict[int, str]) -> Survival:
    """What the layout `layout` placed on `devices` (rank r on devices[r]) survives; `node_of` maps a
    device to its node."""
    process = all(covered(layout, devices, {d}) for d in devices)
    node = all(covered(layout, devices, {d for d in devices if node_of[d] == lost}) for lost in set(map(node_of.get, devices)))
    return Survival(process, node)


def survives_node_loss(layout, sizes: Sequence[int], placement: str) -> bool:
    """Whether `layout` started on nodes of `sizes` GPUs (in device order) keeps a full replica after
    the loss of any one node.

    packed: rank r on the r-th device, nodes numbered node by node. resilient: the planner
    (migrate.allocator) puts each stage's DP replicas, one TP group each, on nodes so that no node
    holds every replica of a stage whenever such a placement exists, else it places packed. A node
    seats size // tp groups and at most dp - 1 of one stage, and stages are interchangeable, so one
    exists exactly when sum(min(size // tp, pp * (dp - 1))) >= pp * dp (for any k stages the nodes
    then seat k * dp groups too: min(c, k x) >= k / pp * min(c, pp x)). When none exists, no placement
    at all survives (that is what such a placement is)."""
    if placement == "resilient":
        cap = layout.groups * (layout.dp - 1)
        return layout.dp >= 2 and sum(min(s // layout.tp, cap) for s in sizes) >= layout.groups * layout.dp
    devices = range(layout.world_size)
    node_of = {d: f"n{i}" for i, size in enumerate(sizes) for d in range(sum(sizes[:i]), sum(sizes[:i]) + size)}
    return survival(layout, devices, node_of).node


def node_choices(sizes: Sequence[int], n: int) -> Iterator[tuple[int, ...]]:
    """Every distinct sequence of GPU counts that n of the nodes `sizes` (in allocation order) can have:
    a shrink, a preempt or a failure may leave any n of them. Nodes grouped by size (the usual
    allocation, a heterogeneous job's components) give few: 4,4,2,2 has 3 for n = 2."""
    if n == 0:
        yield ()
        return
    seen: set[int] = set()
    for i in range(len(sizes) - n + 1):
        if sizes[i] not in seen:  # the first node of each size starts every sequence that begins with it
            seen.add(sizes[i])
            for rest in node_choices(sizes[i + 1:], n - 1):
                yield (sizes[i], *rest)


def auto_checkpoint_every(min_nodes: int, max_nodes: int, gpus_per_node: int | Sequence[int], layouts, model,
                          placement: str) -> int:
    """The safety checkpoint interval when --checkpoint-every is not given: DEFAULT_CHECKPOINT_EVERY when a
    layout the job may run on some node count of its range cannot survive a node loss, else 0.

    `gpus_per_node`: one count (nodes alike) or each node's GPUs in allocation order (uneven nodes;
    nodes beyond the list count as its last). On uneven nodes every choice of n nodes is checked with
    the node sizes it has (node_choices); past MAX_CHOICES choices or MAX_NODES_CHECKED nodes the answer
    is the safe one (checkpoint)."""
    from launcher.policy.layouts import choose_layout, tp_fit
    from migrate.layout import LayoutError

    if max_nodes > MAX_NODES_CHECKED:
        return DEFAULT_CHECKPOINT_EVERY
    sizes = [gpus_per_node] * max_nodes if isinstance(gpus_per_node, int) else list(gpus_per_node)
    sizes += sizes[-1:] * (max_nodes - len(sizes))
    fit = tp_fit(sizes)
    layout_for: dict[int, object] = {}
    checked = 0
    for n in range(min_nodes, max_nodes + 1):
        for held in node_choices(sizes, n):
            checked += 1
            if checked > MAX_CHOICES:
                return DEFAULT_CHECKPOINT_EVERY
            devices = sum(held)
            if devices not in layout_for:
                try:
                    layout_for[devices] = choose_layout(devices, fit, layouts, model)
                except LayoutError:
                    layout_for[devices] = None  # the job cannot run on these nodes: it never does
            layout = layout_for[devices]
            if layout is not None and not survives_node_loss(layout, held, placement):
                return DEFAULT_CHECKPOINT_EVERY
    return 0
