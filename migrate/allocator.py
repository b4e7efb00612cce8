"""Virtual rank allocator (paper III-E): which physical device each new virtual rank runs on.

The paper pairs ranks first and then adds defragmentation moves that communication
coalescing folds back into one hop. We fold the two together up front: the allocator picks
the nodes to keep (whole nodes released on scale-in, pinned nodes kept), cuts them into
TP-group slots (a TP group inside one node), and solves the byte-cost assignment of TP groups
to slots and of ranks to devices inside them. Every state move is then a single hop to its
final device, and no defragmentation pass moves anything twice.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from migrate.layout import LayoutError, ParallelConfig
from migrate.pairing import assign_kinds
from migrate.topology import Topology


@dataclass(frozen=True)
class Placement:
    devices: tuple[int, ...]  # new virtual rank -> device id
    notes: tuple[str, ...]


class Allocator:
    """Places the ranks of `curr` on devices given cost[new class, device kind] in bytes."""

    def __init__(self, curr: ParallelConfig, cost: np.ndarray, device_kind: dict[int, int],
                 topology: Topology, tp_in_node: bool = True) -> None:
        self.curr, self.cost, self.kind, self.topo = curr, cost, device_kind, topology
        self.tp_in_node = tp_in_node
        self.notes: list[str] = []
        self._inner: dict[tuple[int, tuple[int, ...]], tuple[int, np.ndarray]] = {}

    def place(self) -> Placement:
        alive = sorted(self.kind)
        m = self.curr.world_size
        if len(alive) < m:
            raise LayoutError(f"{self.curr} needs {m} devices but only {len(alive)} are available")
        candidates = self._choose_nodes(alive) if len(alive) > m else alive
        return Placement(self._solve(candidates), tuple(dict.fromkeys(self.notes)))

    # -- occupancy: keep as few whole nodes as the layout needs, pinned ones first --------------
    def _choose_nodes(self, alive: list[int]) -> list[int]:
        prelim = self._solve(alive)
        score: dict[str, int] = {n: 0 for n in self.topo.nodes}
        for rank, dev in enumerate(prelim):
            cls = self._class(rank)
            # the last kind is the empty device, so cost[cls, -1] is everything the rank needs
            retained = int(self.cost[cls, -1] - self.cost[cls, self.kind[dev]])
            score[self.topo.devices[dev].node] += retained
        alive_set = set(alive)
        by_node = {n: [d for d in self.topo.node_devices(n) if d in alive_set] for n in self.topo.nodes}
        order = sorted(self.topo.nodes, key=lambda n: (n not in self.topo.pinned, -score[n]))
        kept: list[str] = []
        for node in order:
            if not by_node[node]:
                continue
            kept.append(node)
            devices = sorted(d for n in kept for d in by_node[n])
            if len(devices) >= self.curr.world_size and self._slots_suffice(devices):
                return devices
        return alive

    def _slots_suffice(self, devices: list[int]) -> bool:
        size = self._slot_size()
        return size == 1 or len(self._slots(devices, size)) >= self.curr.pp * self.curr.dp

    # -- efficiency: TP groups inside a node ---------------------------------------------------
    def _slot_size(self) -> int:
        tp = self.curr.tp
        if not self.tp_in_node or tp == 1:
            return 1
        gpn = self.topo.gpus_per_node
        if gpn % tp and tp % gpn:
            self.notes.append(f"tp={tp} does not divide or fill a {gpn}-GPU node: TP groups may span nodes")
            return 1
        return tp

    def _slots(self, devices: list[int], size: int) -> list[tuple[int, ...]]:
        """Aligned blocks of `size` usable devices: inside one node, or whole consecutive nodes."""
        usable = set(devices)
        slots: list[tuple[int, ...]] = []
        gpn = self.topo.gpus_per_node
        if gpn % size == 0:
            for node in self.topo.nodes:
                devs = self.topo.node_devices(node)
                for k in range(0, len(devs), size):
                    block = tuple(devs[k:k + size])
                    if len(block) == size and usable.issuperset(block):
                        slots.append(block)
        else:
            whole = [tuple(self.topo.node_devices(n)) for n in self.topo.nodes
                     if usable.issuperset(self.topo.node_devices(n)) and len(self.topo.node_devices(n)) == gpn]
            per = size // gpn
            for k in range(0, len(whole) - per + 1, per):
                slots.append(tuple(d for node in whole[k:k + per] for d in node))
        return slots

    # -- the assignment ------------------------------------------------------------------------
    def _class(self, rank: int) -> int:
        pp, _dp, tp = self.curr.coords(rank)
        return pp * self.curr.tp + tp

    def _solve(self, devices: list[int]) -> tuple[int, ...]:
        size = self._slot_size()
        slots = self._slots(devices, size) if size > 1 else [(d,) for d in devices]
        groups_needed = self.curr.pp * self.curr.dp
        if size > 1 and len(slots) < groups_needed:
            self.notes.append(f"only {len(slots)} node-local slots for {groups_needed} TP groups of {size}: "
                              "TP groups span nodes")
            size, slots = 1, [(d,) for d in devices]
        # row kinds: one per PP stage (size > 1: whole TP groups) or per class (size == 1)
        row_members = ([[p * self.curr.tp + t for t in range(self.curr.tp)] for p in range(self.curr.pp)]
                       if size > 1 else [[c] for c in range(self.curr.pp * self.curr.tp)])
        col_keys: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for slot in slots:
            key = tuple(sorted(self.kind[d] for d in slot))
            col_keys.setdefault(key, []).append(tuple(sorted(slot, key=lambda d: self.kind[d])))
        keys = list(col_keys)
        cost = np.array([[self._inner_cost(r, members, key)[0] for key in keys]
                         for r, members in enumerate(row_members)], dtype=np.int64)
        counts = assign_kinds(cost, [self.curr.dp] * len(row_members), [len(col_keys[k]) for k in keys])
        placement = [-1] * self.curr.world_size
        next_group = [0] * len(row_members)
        next_slot = [0] * len(keys)
        for (r, c), n in sorted(counts.items()):
            perm = self._inner_cost(r, row_members[r], keys[c])[1]
            for _ in range(n):
                group_ranks = self._group_ranks(r, next_group[r], size)
                slot = col_keys[keys[c]][next_slot[c]]
                next_group[r] += 1
                next_slot[c] += 1
                for member, rank in enumerate(group_ranks):
                    placement[rank] = slot[perm[member]]
        return tuple(placement)

    def _group_ranks(self, row: int, index: int, size: int) -> list[int]:
        """Ranks of the `index`-th unit of row kind `row` (DP replicas in order)."""
        if size > 1:
            return [self.curr.rank(row, index, t) for t in range(self.curr.tp)]
        pp, tp = divmod(row, self.curr.tp)
        return [self.curr.rank(pp, index, tp)]

    def _inner_cost(self, row: int, members: list[int], key: tuple[int, ...]) -> tuple[int, np.ndarray]:
        """Best cost of one TP group on one slot, and member -> slot position. Memoised by kinds."""
        memo = self._inner.get((row, key))
        if memo is None:
            sub = self.cost[np.ix_(members, list(key))]
            ri, ci = linear_sum_assignment(sub)
            perm = np.empty(len(members), dtype=np.int64)
            perm[ri] = ci
            memo = (int(sub[ri, ci].sum()), perm)
            self._inner[(row, key)] = memo
        return memo
