"""`plan()`: from an old layout on some devices to a new one, the least data movement there is.

Pure: no processes, no torch. The result is a frozen `MigrationPlan` that prints, serialises
to JSON and is what every worker executes and what the database records.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from migrate.allocator import Allocator, Placement
from migrate.instructions import Expander, Instruction, LostStateError, Needs, check_lost
from migrate.layout import LayoutError, ModelSpec, ParallelConfig
from migrate.topology import RankMap, Topology
from migrate.workload import ByteModel, Workload, class_workloads, slice_units

EMPTY = Workload(0, 0, 0, 0, 1, False, False)


@dataclass(frozen=True)
class MigrationPlan:
    model: ModelSpec
    prev: RankMap
    curr: RankMap
    topology: Topology
    failed: tuple[int, ...]
    units: int
    bytes_state_total: int
    nodes_released: tuple[str, ...]
    notes: tuple[str, ...] = ()
    plan_ms: float = field(default=0.0, compare=False)
    bytes_lower_bound: int = 0  # no placement under the node (and placement) rule moves less
    bytes_lower_bound_no_rule: int = 0  # no placement at all moves less: TP groups anywhere
    optimal: bool = False  # proven: no placement under the node rule (and placement rule) moves less
    placement_rule: str = "packed"

    # -- instructions: derived from the placement, per class, only when asked ------------------
    @cached_property
    def expander(self) -> Expander:
        return Expander(self.prev.layout, self.prev.devices, self.curr.layout, self.curr.devices,
                        frozenset(self.failed), self.model.layers, self.units,
                        ByteModel.of_model(self.model, self.units), self.model.state_kinds)

    @cached_property
    def instructions(self) -> tuple[Instruction, ...]:
        """Every device's instructions (large at scale: a worker needs only `instructions_for`)."""
        return tuple(self.expander.all())

    def instructions_for(self, device: int) -> list[Instruction]:
        """What one device does: its sends, its receives and its refers, expanded for it alone."""
        return self.expander.for_device(device)

    @cached_property
    def _traffic(self) -> tuple[dict[int, int], dict[int, int], dict[str, int]]:
        return self.expander.traffic()

    # -- derived figures ------------------------------------------------------------------------
    @property
    def bytes_moved(self) -> int:
        """Bytes that cross between devices."""
        return sum(self._traffic[1].values())

    @property
    def bytes_checkpoint(self) -> int:
        """A save + load through storage: one replica written, every new rank's share read back."""
        return self.bytes_state_total * (1 + self.curr.layout.dp)

    def _per_device(self, op: str, attr: str = "") -> dict[int, int]:
        """Bytes per device: sent by it (op "send") or received by it (op "recv")."""
        return dict(self._traffic[0] if op == "send" else self._traffic[1])

    @property
    def max_device_send_bytes(self) -> int:
        return max(self._traffic[0].values(), default=0)

    @property
    def max_device_recv_bytes(self) -> int:
        return max(self._traffic[1].values(), default=0)

    @property
    def pairs(self) -> list[tuple[int, int | None]]:
        """[new rank, old device it reuses or None for a device that held no state]."""
        old = set(self.prev.devices) - set(self.failed)
        return [(r, d if d in old else None) for r, d in enumerate(self.curr.devices)]

    # -- serialisation --------------------------------------------------------------------------
    def placement(self) -> list[dict]:
        out = []
        cfg = self.curr.layout
        for r, d in enumerate(self.curr.devices):
            pp, dp, tp = cfg.coords(r)
            dev = self.topology.devices[d]
            out.append({"rank": r, "device": d, "node": dev.node, "gpu": dev.gpu, "pp": pp, "dp": dp, "tp": tp,
                        **({"fsdp": cfg.fsdp_rank(r)} if cfg.fsdp > 1 else {})})
        return out

    def summary(self) -> dict:
        return {
            "from": str(self.prev.layout), "to": str(self.curr.layout),
            "pairs": [list(p) for p in self.pairs],
            "placement": self.placement(),
            "bytes_moved": self.bytes_moved,
            "bytes_lower_bound": self.bytes_lower_bound,
            "bytes_lower_bound_no_rule": self.bytes_lower_bound_no_rule,
            "optimal": self.optimal,
            "placement_rule": self.placement_rule,
            "bytes_state_total": self.bytes_state_total,
            "bytes_checkpoint": self.bytes_checkpoint,
            "max_device_send_bytes": self.max_device_send_bytes,
            "max_device_recv_bytes": self.max_device_recv_bytes,
            "nodes_released": list(self.nodes_released),
            "instruction_counts": dict(self._traffic[2]),
            "notes": list(self.notes),
            "plan_ms": round(self.plan_ms, 3),
        }

    def to_dict(self, instructions: bool = True) -> dict:
        """Everything needed to rebuild the plan; `instructions=False` leaves out the (derivable) list."""
        d = self.summary()
        d.update({
            "model": {k: getattr(self.model, k) for k in
                      ("layers", "hidden", "heads", "ffn", "vocab", "seq_len", "dtype", "optimizer")},
            "prev_devices": list(self.prev.devices), "curr_devices": list(self.curr.devices),
            "topology": {"devices": [[x.node, x.gpu] for x in self.topology.devices],
                         "pinned": sorted(self.topology.pinned), "tp_domain": self.topology.tp_domain},
            "failed": list(self.failed), "units": self.units,
        })
        if instructions:
            d["instructions"] = [i.to_dict() for i in self.instructions]
        return d

    def to_json(self, instructions: bool = True) -> str:
        return json.dumps(self.to_dict(instructions))

    @classmethod
    def from_dict(cls, d: dict) -> "MigrationPlan":
        from migrate.topology import Device

        if d.get("by_manifest"):
            raise LayoutError(f"{d['from']} -> {d['to']} is an FSDP plan (by manifest): plan it again, its "
                              "moves are not the reference GPT's instructions")

        topo = Topology(tuple(Device(i, n, g) for i, (n, g) in enumerate(d["topology"]["devices"])),
                        frozenset(d["topology"]["pinned"]), d["topology"].get("tp_domain"))
        return cls(
            model=ModelSpec(**d["model"]),
            prev=RankMap(ParallelConfig.parse(d["from"]), tuple(d["prev_devices"])),
            curr=RankMap(ParallelConfig.parse(d["to"]), tuple(d["curr_devices"])),
            topology=topo, failed=tuple(d["failed"]), units=d["units"],
            bytes_state_total=d["bytes_state_total"], nodes_released=tuple(d["nodes_released"]),
            notes=tuple(d["notes"]), plan_ms=d["plan_ms"], bytes_lower_bound=d.get("bytes_lower_bound", 0),
            bytes_lower_bound_no_rule=d.get("bytes_lower_bound_no_rule", 0),
            optimal=d.get("optimal", False), placement_rule=d.get("placement_rule", "packed"),
        )


@dataclass(frozen=True)
class Move:
    """One piece of a ShardedPlan: the elements `box` of tensor `fqn` from device `src` to device `dst`
    (src == dst: kept in place, op "refer")."""

    op: str
    src: int
    dst: int
    fqn: str
    box: tuple[tuple[int, int], ...]
    nbytes: int

    def to_dict(self) -> dict:
        return {"op": self.op, "src": self.src, "dst": self.dst, "fqn": self.fqn, "box": [list(b) for b in self.box],
                "nbytes": self.nbytes}


@dataclass(frozen=True)
class ShardedPlan(MigrationPlan):
    """A plan between layouts the rectangle byte model does not describe: with FSDP a rank holds a box of
    each tensor (dim 0 of its TP piece cut once more, migrate.manifest), so the bytes come from the state
    manifests (migrate.manifest.gpt_manifest, box overlaps), the placement from the same allocator, and the
    pieces each device sends and keeps from migrate.reshard.plan_transfers (what live mode moves)."""

    moves: tuple[Move, ...] = ()

    def summary(self) -> dict:
        return {**super().summary(), "by_manifest": True}

    @cached_property
    def expander(self) -> Expander:
        raise LayoutError("an FSDP plan has no Send/Recv/Refer segments of the reference GPT: see its moves")

    @cached_property
    def instructions(self) -> tuple[Move, ...]:
        return self.moves

    def instructions_for(self, device: int) -> list[Move]:
        return [m for m in self.moves if device in (m.src, m.dst)]

    @cached_property
    def _traffic(self) -> tuple[dict[int, int], dict[int, int], dict[str, int]]:
        send: dict[int, int] = {}
        recv: dict[int, int] = {}
        counts = {"send": 0, "recv": 0, "refer": 0}
        for m in self.moves:
            if m.op == "refer":
                counts["refer"] += 1
                continue
            counts["send"] += 1
            counts["recv"] += 1
            send[m.src] = send.get(m.src, 0) + m.nbytes
            recv[m.dst] = recv.get(m.dst, 0) + m.nbytes
        return send, recv, counts


def _plan_sharded(model: ModelSpec, prev_map: RankMap, curr: ParallelConfig, topology: Topology, failed,
                  tp_in_node: bool, placement: str, unusable, t0: float) -> ShardedPlan:
    """plan() where either layout shards over FSDP (see ShardedPlan)."""
    from dataclasses import replace

    from migrate.manifest import Manifest, ManifestError, class_cost, gpt_manifest, layout_manifests
    from migrate.reshard import plan_transfers, transfer_bytes

    prev_cfg = prev_map.layout
    for cfg in (prev_cfg, curr):
        model.check_config(replace(cfg, fsdp=1))
    _check_devices(prev_map, topology, failed)
    old_cls = layout_manifests(prev_cfg, lambda r: gpt_manifest(model, prev_cfg, r))
    new_cls = layout_manifests(curr, lambda r: gpt_manifest(model, curr, r))
    cost = class_cost(new_cls, old_cls + [Manifest(())])
    placed = place(curr, cost, prev_map, topology, failed, tp_in_node, placement, unusable)
    need_total = int(cost[:, -1].sum()) * curr.dp
    old_ms = [Manifest(()) if d in failed else old_cls[c] for d, c in zip(prev_map.devices, prev_cfg.class_list())]
    new_ms = [new_cls[c] for c in curr.class_list()]
    same = {r: prev_map.devices.index(d) for r, d in enumerate(placed.devices)
            if d in prev_map.devices and d not in failed}
    try:
        transfers = plan_transfers(old_ms, new_ms, same)
    except ManifestError as exc:
        raise LostStateError([str(exc)]) from None
    entries = [m.by_fqn() for m in new_cls]
    classes = curr.class_list()
    moves = tuple(Move("refer" if same.get(t.dst) == t.src else "send", prev_map.devices[t.src],
                       placed.devices[t.dst], t.fqn, t.box, transfer_bytes(t, entries[classes[t.dst]][t.fqn]))
                  for t in transfers)
    released = _released(prev_map, placed.devices, topology, failed)
    total = sum(e.nbytes for e in {e for m in new_cls for e in m.entries})  # every piece once
    result = ShardedPlan(model, prev_map, RankMap(curr, placed.devices), topology, tuple(sorted(failed)), 1, total,
                         released, placed.notes, 0.0, need_total - placed.rule_bound, need_total - placed.upper_bound,
                         placed.optimal, placement, moves)
    object.__setattr__(result, "plan_ms", (time.perf_counter() - t0) * 1000)
    return result


def plan(model: ModelSpec, prev: RankMap | ParallelConfig, curr: ParallelConfig, topology: Topology,
         failed: frozenset[int] | set[int] = frozenset(), tp_in_node: bool = True,
         placement: str = "packed", unusable: frozenset[int] | set[int] = frozenset()) -> MigrationPlan:
    """Plan the move of `model`'s state from `prev` (a layout on devices) to `curr` on `topology`.

    `tp_in_node=False` drops the node rule (tests and what-ifs); `placement="resilient"` keeps
    the DP replicas of every stage off any single node (see migrate.allocator). `unusable`: devices
    outside the old layout that get no rank either (their worker died earlier). Layouts with FSDP
    get a ShardedPlan (bytes by manifest).
    """
    t0 = time.perf_counter()
    prev_map = prev if isinstance(prev, RankMap) else RankMap.identity(prev)
    prev_cfg = prev_map.layout
    if prev_cfg.fsdp > 1 or curr.fsdp > 1:
        return _plan_sharded(model, prev_map, curr, topology, frozenset(failed), tp_in_node, placement,
                             frozenset(unusable), t0)
    model.check_config(prev_cfg)
    model.check_config(curr)
    _check_devices(prev_map, topology, failed)

    units = slice_units(prev_cfg.tp, curr.tp)
    bm = ByteModel.of_model(model, units)
    prev_ws = class_workloads(prev_cfg, model.layers, units)
    curr_ws = class_workloads(curr, model.layers, units)
    cost = bm.cost(curr_ws, prev_ws + [EMPTY])  # last column: a device that holds nothing

    empty_kind = len(prev_ws)
    kind_of, alive = _device_kinds(prev_map, topology, failed, unusable)
    placed = place(curr, cost, prev_map, topology, failed, tp_in_node, placement, unusable)
    need_total = int(cost[:, -1].sum()) * curr.dp

    released = _released(prev_map, placed.devices, topology, failed)
    result = MigrationPlan(model, prev_map, RankMap(curr, placed.devices), topology, tuple(sorted(failed)), units,
                           model.state_bytes, released, placed.notes, 0.0, need_total - placed.rule_bound,
                           need_total - placed.upper_bound, placed.optimal, placement)
    # a piece no surviving device holds is lost: check once per (new class, old kind) in use
    ranks = np.arange(curr.world_size)
    classes = (ranks // (curr.tp * curr.dp)) * curr.tp + ranks % curr.tp
    pairs = np.unique(classes * (empty_kind + 1) + kind_of[list(placed.devices)])
    failed_holders: dict[int, list[int]] = {}
    for d in sorted(failed):
        failed_holders.setdefault(int(kind_of[d]), []).append(d)
    check_lost(Needs(prev_cfg, model.layers, units, bm), curr_ws, prev_ws,
               [(int(c), None if int(k) == empty_kind else int(k)) for c, k in zip(*divmod(pairs, empty_kind + 1))],
               set(np.unique(kind_of[alive]).tolist()) - {empty_kind}, failed_holders)
    object.__setattr__(result, "plan_ms", (time.perf_counter() - t0) * 1000)
    return result


def _released(prev: RankMap, devices: tuple[int, ...], topology: Topology, failed) -> tuple[str, ...]:
    """The nodes the old layout used (failed devices aside) that `devices` leave, but the pinned one."""
    gone = {topology.devices[d].node for d in prev.devices if d not in failed} - \
        {topology.devices[d].node for d in devices}
    return tuple(n for n in topology.nodes if n in gone and n not in topology.pinned)


def _device_kinds(prev: RankMap, topology: Topology, failed, unusable=frozenset()) -> tuple[np.ndarray, np.ndarray]:
    """(old class each device holds, or the empty kind; which devices are alive and usable)."""
    cfg = prev.layout
    empty_kind = cfg.classes
    kind_of = np.full(len(topology.devices), empty_kind, dtype=np.int64)
    kind_of[list(prev.devices)] = cfg.class_list()
    alive = np.ones(len(topology.devices), dtype=bool)
    alive[list(failed)] = False
    alive[list(unusable)] = False
    return kind_of, alive


def place(curr: ParallelConfig, cost: np.ndarray, prev: RankMap, topology: Topology,
          failed: frozenset[int] | set[int] = frozenset(), tp_in_node: bool = True,
          placement: str = "packed", unusable: frozenset[int] | set[int] = frozenset()) -> Placement:
    """Where the ranks of `curr` go for any byte workload: the planner's interface to a state source.

    cost[new class, old class] is the bytes a rank of a new class (pp * tp + tp rank) lacks on a
    device holding an old class, with a last column for a device that holds nothing. The
    reference GPT's comes from `ByteModel`; any model's from its state manifests
    (`migrate.manifest.class_cost(new, old + [empty manifest])`).
    """
    kind_of, alive = _device_kinds(prev, topology, failed, unusable)
    device_kind = dict(zip(np.flatnonzero(alive).tolist(), kind_of[alive].tolist()))
    need = cost[:, -1]
    return Allocator(curr, need[:, None] - cost, device_kind, topology, tp_in_node, placement).place()


def _check_devices(prev: RankMap, topology: Topology, failed: frozenset[int] | set[int]) -> None:
    n = len(topology.devices)
    bad = [d for d in prev.devices if not 0 <= d < n]
    if bad:
        raise LayoutError(f"the old layout runs on devices {bad} that are not in the topology of {n} devices")
    if len(failed) > len(prev.devices):
        raise LayoutError(f"{len(failed)} failed devices but the old layout has only {len(prev.devices)}")
    unknown = sorted(d for d in failed if d not in set(prev.devices))
    if unknown:
        raise LayoutError(f"failed device(s) {unknown} do not run the old layout (devices 0-{n - 1}, "
                          f"old layout on {sorted(prev.devices)[:8]}...)")
