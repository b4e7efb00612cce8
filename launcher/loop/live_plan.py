"""Pure planning of a live move: which layout, where its ranks go, and what the move costs in bytes.

A live-mode model is known to the launcher only as "generic": the workers offer per-rank state
manifests built on the meta device (the model spec's `manifests`, per layout shape), and plan and
move the state themselves (migrate.manifest, migrate.reshard). Here the launcher places ranks with
the ETC planner (migrate.plan.place) over the byte cost of those manifests, and checks, purely, that
the replicas left after a failure cover the state (migrate.reshard.plan_transfers). Nothing here
talks to a process: launcher.loop.live carries a plan out.
"""
from __future__ import annotations

from launcher.options import model_from_command
from launcher.policy.layouts import choose_layout
from migrate.layout import LayoutError, ParallelConfig
from migrate.manifest import Manifest, ManifestError, class_cost
from migrate.plan import place
from migrate.reshard import plan_transfers, transfer_bytes
from migrate.topology import RankMap, Topology

__all__ = ["LayoutError", "ManifestError", "choose", "known_model", "placement", "plan_bytes", "shapes"]

#: the most devices whose layouts are enumerated up front (shapes) for a job without --layouts
MAX_SHAPE_DEVICES = 1024


def known_model(opts):
    """The job's ModelSpec when its program is the reference worker (python -m launcher.worker, read from
    its model flags as options do), else None: a model only the workers know."""
    return opts.model if opts.model is not None else model_from_command(opts.command)


def choose(devices: int, tp_fit: int, layouts, model):
    """The layout on `devices` devices: `layouts` (--layouts: any PP x TP x DP: the workers build their stages
    and manifests themselves), each checked against the job's ModelSpec `model` when the launcher knows it
    (a layout the model cannot take is refused with the reason, before anything moves: launcher.policy);
    without --layouts every grid the model takes, or pure DP for a model the launcher does not know."""
    if not layouts and model is None:
        return ParallelConfig(dp=devices)
    return choose_layout(devices, tp_fit, list(layouts), model)


def shape(layout) -> str:
    """What a layout's state manifests depend on: its pipeline, TP and FSDP sizes (not DP: replicas)."""
    return f"pp{layout.pp}tp{layout.tp}" + (f"fsdp{layout.fsdp}" if layout.fsdp > 1 else "")


def shapes(opts, tp_fit: int, largest_node: int) -> list[str]:
    """Every layout shape the job may run (control.KEY_SHAPES: the workers offer their manifests for these):
    those of --layouts, or, for the reference worker without --layouts, of every layout the policy picks
    on 1 to the job's most devices (`largest_node` devices on each of --nnodes MAX nodes)."""
    out = {shape(c) for c in opts.layouts} | {"pp1tp1"}
    model = known_model(opts)
    if model is not None and not opts.layouts:
        for d in range(1, min(opts.max_nodes * largest_node, MAX_SHAPE_DEVICES) + 1):
            try:
                out.add(shape(choose_layout(d, tp_fit, (), model)))
            except LayoutError:
                continue
    return sorted(out)


def class_manifests(spec: dict | None, layout) -> list:
    """The manifest of each class (migrate.layout.ParallelConfig.class_of) of `layout`, as the workers offered them in
    their model spec `spec` (launcher.runtime.join, for the shapes of control.KEY_SHAPES)."""
    got = (spec or {}).get("manifests", {}).get(shape(layout))
    if got is None:
        raise LayoutError(f"the workers offered no state manifests for {shape(layout)}")
    return [Manifest.from_list(m) for m in got]


def rank_manifests(spec: dict | None, layout) -> list:
    """One manifest per rank of `layout` (DP replicas hold their class's)."""
    classes = class_manifests(spec, layout)
    return [classes[c] for c in layout.class_list()]


def placement(spec: dict | None, topology, rule: str, layout, prev, target: list[str], failed=frozenset(),
              unusable=frozenset()):
    """Where the ranks of `layout` go on the nodes `target` of `topology`: the ETC placement
    (migrate.plan.place) over the byte cost of the state manifests (migrate.manifest.class_cost), with
    --placement's `rule`."""
    cost = class_cost(class_manifests(spec, layout), class_manifests(spec, prev.layout) + [Manifest(())])
    outside = {d.id for d in topology.devices if d.node not in set(target)}
    placed = place(layout, cost, prev, Topology(topology.devices, frozenset(target)), frozenset(failed), True,
                   rule, frozenset((set(unusable) | outside) - set(failed)))
    return placed.devices


def start_devices(spec: dict | None, topology, rule: str, layout, nodes: list[str]) -> tuple[int, ...]:
    """Where the ranks start: in device order (--placement packed, or DP = 1), else where the planner's
    resilient placement puts them (no node holds every replica of a stage; the manifests are the workload)."""
    devices = tuple(d for n in nodes for d in topology.node_devices(n))[:layout.world_size]
    if rule == "packed" or layout.dp < 2:
        return devices
    return placement(spec, topology, rule, layout, RankMap(layout, devices), nodes)


def plan_bytes(spec: dict | None, old, new, failed) -> dict:
    """What the move costs, as `elastic plan` reports an ETC plan (pure): bytes_moved (crossing between
    processes), bytes_state_total (one replica of the new layout's state) and bytes_checkpoint (a save
    and load through storage instead: one replica written, every new rank's share read back).
    ManifestError when some piece of the new layout's state has no surviving holder."""
    old_ms = [Manifest(()) if d in set(failed) else m for d, m in zip(old.devices, rank_manifests(spec, old.layout))]
    same = {r: old.devices.index(d) for r, d in enumerate(new.devices) if d in old.devices and d not in set(failed)}
    new_ms = rank_manifests(spec, new.layout)
    transfers = plan_transfers(old_ms, new_ms, same)
    entries = {id(m): m.by_fqn() for m in new_ms}  # DP replicas share their class's manifest
    moved = sum(transfer_bytes(t, entries[id(new_ms[t.dst])][t.fqn]) for t in transfers if same.get(t.dst) != t.src)
    # every piece once (a TP-replicated one, e.g. a layer norm, is in every TP rank's manifest)
    total = sum(e.nbytes for e in {e for m in class_manifests(spec, new.layout) for e in m.entries})
    return {"bytes_moved": moved, "bytes_state_total": total, "bytes_checkpoint": total * (1 + new.layout.dp)}
