"""Physical devices, the nodes they sit on, and the map from virtual ranks to them."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from migrate.layout import LayoutError, ParallelConfig


@dataclass(frozen=True)
class Device:
    id: int
    node: str
    gpu: int


@dataclass(frozen=True)
class Topology:
    """The devices a job may use. Pinned nodes (the one running the batch script) are never released.

    Nodes may differ in GPU count. `tp_domain` declares NVLink islands smaller than a node: GPUs
    gpu // tp_domain of a node form one island, and a TP group that fits in an island stays
    inside one. None (the default) means the whole node is one NVSwitch domain, where any
    subset of its GPUs is as good as another.
    """

    devices: tuple[Device, ...]
    pinned: frozenset[str] = frozenset()
    tp_domain: int | None = None

    def __post_init__(self) -> None:
        if [d.id for d in self.devices] != list(range(len(self.devices))):
            raise LayoutError("device ids must be 0..n-1 in order")
        unknown = self.pinned - set(self.nodes)
        if unknown:
            raise LayoutError(f"pinned node(s) {sorted(unknown)} are not in the topology")
        if self.tp_domain is not None and (not isinstance(self.tp_domain, int) or self.tp_domain < 1):
            raise LayoutError(f"tp_domain must be a positive number of GPUs, got {self.tp_domain!r}")

    @classmethod
    def grid(cls, nodes: int, gpus_per_node: int, names: list[str] | None = None,
             pinned: tuple[str, ...] | None = None, tp_domain: int | None = None) -> "Topology":
        """`nodes` x `gpus_per_node` devices; by default the first node is pinned (it runs the batch script)."""
        if nodes < 1 or gpus_per_node < 1:
            raise LayoutError(f"need at least one node and one GPU per node, got {nodes} x {gpus_per_node}")
        return cls.of_nodes([gpus_per_node] * nodes, names, pinned, tp_domain)

    @classmethod
    def of_nodes(cls, sizes: "list[int] | tuple[int, ...]", names: list[str] | None = None,
                 pinned: tuple[str, ...] | None = None, tp_domain: int | None = None) -> "Topology":
        """Nodes with `sizes[i]` GPUs each (uneven nodes, e.g. [4, 4, 2, 2]); the first node is pinned by default."""
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise LayoutError(f"need at least one node and one GPU per node, got node sizes {list(sizes)}")
        names = names or [f"node{i}" for i in range(len(sizes))]
        if len(names) != len(sizes):
            raise LayoutError(f"{len(sizes)} nodes but {len(names)} names")
        devices, first = [], 0
        for name, size in zip(names, sizes):
            devices += [Device(first + g, name, g) for g in range(size)]
            first += size
        return cls(tuple(devices), frozenset(names[:1] if pinned is None else pinned), tp_domain)

    @cached_property
    def _by_node(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for d in self.devices:
            out.setdefault(d.node, []).append(d.id)
        return out

    @property
    def nodes(self) -> list[str]:
        """Node names in device order."""
        return list(self._by_node)

    @cached_property
    def gpus_per_node(self) -> int:
        """The largest node's GPU count (see `node_sizes` for uneven nodes)."""
        return max(len(v) for v in self._by_node.values())

    @property
    def node_sizes(self) -> list[int]:
        """GPU count of every node, in node order."""
        return [len(v) for v in self._by_node.values()]

    def islands(self, node: str, group: int) -> list[list[int]]:
        """Device ids of `node` cut into the domains a TP group of `group` GPUs must stay inside."""
        devs = self._by_node[node]
        k = self.tp_domain
        if k is None or group > k:
            return [list(devs)]
        out: dict[int, list[int]] = {}
        for d in devs:
            out.setdefault(self.devices[d].gpu // k, []).append(d)
        return list(out.values())

    def node_devices(self, node: str) -> list[int]:
        return self._by_node[node]


@dataclass(frozen=True)
class RankMap:
    """Virtual rank r of `layout` runs on device `devices[r]`."""

    layout: ParallelConfig
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.devices) != self.layout.world_size:
            raise LayoutError(f"{self.layout} has {self.layout.world_size} ranks but the rank map places {len(self.devices)}")
        if len(set(self.devices)) != len(self.devices):
            raise LayoutError("a rank map places two ranks on one device")

    @classmethod
    def identity(cls, layout: ParallelConfig) -> "RankMap":
        return cls(layout, tuple(range(layout.world_size)))

    def rank_of(self) -> dict[int, int]:
        """device id -> virtual rank."""
        return {d: r for r, d in enumerate(self.devices)}
