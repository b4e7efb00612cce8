"""A simulated per-device state: sets of atomic state units, to check plans without processes."""
from __future__ import annotations

from migrate.instructions import Segment
from migrate.plan import MigrationPlan
from migrate.workload import Workload, class_workloads

Unit = tuple


def workload_units(w: Workload) -> set[Unit]:
    out: set[Unit] = set()
    for layer in range(w.layer_lo, w.layer_hi):
        out.add(("layers", layer, "r"))
        out.update(("layers", layer, k) for k in range(w.slice_lo, w.slice_hi))
    for block, flag in (("embed", w.first), ("head", w.last)):
        if flag:
            out.add((block, 0, "r"))
            out.update((block, 0, k) for k in range(w.slice_lo, w.slice_hi))
    return out


def segment_units(s: Segment) -> set[Unit]:
    layers = range(s.layer_lo, s.layer_hi) if s.block == "layers" else [0]
    if s.part == "replicated":
        return {(s.block, layer, "r") for layer in layers}
    return {(s.block, layer, k) for layer in layers for k in range(s.slice_lo, s.slice_hi)}


def layout_state(plan: MigrationPlan, which: str) -> dict[int, set[Unit]]:
    """device -> units it holds under the old ('prev') or new ('curr') layout."""
    rmap = plan.prev if which == "prev" else plan.curr
    ws = class_workloads(rmap.layout, plan.model.layers, plan.units)
    out = {}
    for rank, dev in enumerate(rmap.devices):
        pp, _dp, tp = rmap.layout.coords(rank)
        out[dev] = workload_units(ws[pp * rmap.layout.tp + tp])
    return out


def apply(plan: MigrationPlan) -> dict[int, set[Unit]]:
    """Run the instructions on the simulated old state; assert the invariants a real run relies on."""
    old = layout_state(plan, "prev")
    for dev in plan.failed:
        old.pop(dev, None)
    new: dict[int, set[Unit]] = {d: set() for d in plan.curr.devices}
    sends = sorted((i.src, i.dst, i.segment) for i in plan.instructions if i.op == "send")
    recvs = sorted((i.src, i.dst, i.segment) for i in plan.instructions if i.op == "recv")
    assert sends == recvs, "every send has exactly one matching recv"
    for ins in plan.instructions:
        units = segment_units(ins.segment)
        if ins.op == "send":
            continue
        assert ins.src in old and units <= old[ins.src], f"{ins} uses state its source does not hold"
        if ins.op == "refer":
            assert ins.src == ins.dst
        else:
            assert ins.src != ins.dst
        assert ins.dst in new, f"{ins} targets a device outside the new layout"
        assert not (units & new[ins.dst]), f"{ins} delivers units the device already got"
        new[ins.dst] |= units
    return new
