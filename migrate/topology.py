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
    """The devices a job may use. Pinned nodes (the one running the batch script) are never released."""

    devices: tuple[Device, ...]
    pinned: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if [d.id for d in self.devices] != list(range(len(self.devices))):
            raise LayoutError("device ids must be 0..n-1 in order")
        unknown = self.pinned - set(self.nodes)
        if unknown:
            raise LayoutError(f"pinned node(s) {sorted(unknown)} are not in the topology")

    @classmethod
    def grid(cls, nodes: int, gpus_per_node: int, names: list[str] | None = None,
             pinned: tuple[str, ...] | None = None) -> "Topology":
        """`nodes` x `gpus_per_node` devices; by default the first node is pinned (it runs the batch script)."""
        if nodes < 1 or gpus_per_node < 1:
            raise LayoutError(f"need at least one node and one GPU per node, got {nodes} x {gpus_per_node}")
        names = names or [f"node{i}" for i in range(nodes)]
        if len(names) != nodes:
            raise LayoutError(f"{nodes} nodes but {len(names)} names")
        devices = tuple(Device(n * gpus_per_node + g, names[n], g) for n in range(nodes) for g in range(gpus_per_node))
        return cls(devices, frozenset(names[:1] if pinned is None else pinned))

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
        return max(len(v) for v in self._by_node.values())

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
