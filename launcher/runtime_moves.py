"""Migrations of a live-mode job whose program uses the public runtime API (launcher.runtime).

Such a model is known to the launcher only as "generic": the workers plan and move its state
themselves from per-rank manifests built on the meta device (migrate.manifest, migrate.reshard).
The launcher picks the layout and devices, starts workers on new nodes, posts one `reshard` event
that applies at an agreed step boundary, waits for every participant, records the rank map and
the migration, and gives the nodes that left back. Worker failure recovery and suspend are the
reference worker's (launcher.worker) only for now.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.loop import Launcher


def layouts_for(la: "Launcher"):
    """Allowed layouts of a generic model: --layouts without pipeline stages, else pure DP."""
    return [c for c in la.opts.layouts if c.pp == 1]


def choose(la: "Launcher", devices: int):
    from launcher.policy import choose_layout
    from migrate.layout import ParallelConfig

    allowed = layouts_for(la)
    if not allowed:
        return ParallelConfig(dp=devices)
    return choose_layout(devices, la.gpn, allowed, None)


def move(la: "Launcher", target: list[str], trigger: str):
    """Move the job onto the nodes `target` with the next layout; one recorded Outcome."""
    from launcher.transaction import MigrationFailed, Outcome
    from migrate.layout import LayoutError
    from migrate.topology import RankMap

    target = [n for n in la.alloc if n in set(target)]
    before, old = la.active, la.current
    out = Outcome(trigger, False, "", from_layout=str(old.layout), nodes_before=len(before),
                  nodes_after=len(before))
    try:
        layout = choose(la, sum(len(la.node_devices(n)) for n in target))
    except LayoutError as exc:
        out.message = f"no layout: {exc}"
        la.outcomes.append(out)
        return out
    devices = tuple(d for n in target for d in la.node_devices(n))[:layout.world_size]
    new = RankMap(layout, devices)
    out.to_layout = str(layout)
    new_nodes = [n for n in target if n not in la.handles]
    leaving = [n for n in before if n not in target]
    mid = la.db.start_migration(la.job_id, out.from_layout, out.to_layout, trigger,
                                {"generic": True, "nodes": target}, la.db.fragmentation(la.job_id))
    out.migration_id = mid
    e = la.epoch + 1
    t0 = time.perf_counter()
    try:
        if new_nodes:
            la.start_nodes(new_nodes, e)
            la.wait_ready(new_nodes)
        parts = sorted(set(old.devices) | set(devices))
        la.epoch = e
        la.ctl.post({"epoch": e, "kind": "reshard", "participants": parts,
                     "prev": {"layout": str(old.layout), "devices": list(old.devices)},
                     "curr": {"layout": str(layout), "devices": list(devices)},
                     "exit_ok": sorted(d for n in leaving for d in la.node_devices(n))})
        la.log(f"event {e}: {out.from_layout} -> {out.to_layout} on {','.join(target)} ({trigger})")
        results = la.check_results(la.wait_results(e, parts))
    except MigrationFailed as exc:
        out.message = f"migration failed: {exc}"
        la.db.finish_migration(mid, "failed", None, None, None, {}, error=out.message)
        la.outcomes.append(out)
        return out
    phases = {k: max(r.get("phases", {}).get(k, 0.0) for r in results.values())
              for k in ("build_groups", "execute", "rebuild")}
    phases["plan"] = 0.0
    la.current, la.world = new, f"w{e}"
    la.db.record_rank_map(la.job_id, la.epoch_base + e, str(layout), la.entries(new))
    la.db.update_job(la.job_id, layout=str(layout))
    for n in leaving:
        la.reap(n)
    error = None
    if leaving:
        try:
            la.backend.release([n for n in la.alloc if n not in leaving and n not in la.gone])
            for n in leaving:
                la.db.set_node_state(la.job_id, n, "released")
        except Exception as exc:  # SlurmError: the job trains on, the nodes stay allocated
            error = f"node release failed (nodes stay allocated, idle): {exc}"
    steps = {r["step"] for r in results.values() if r.get("step") is not None}
    out.at_step = min(steps) if steps else None
    out.bytes_moved = sum(r.get("bytes_moved", 0) for r in results.values())
    la.db.finish_migration(mid, "succeeded", out.bytes_moved, None, None, phases, error=error,
                           fragmentation_after=la.db.fragmentation(la.job_id), at_step=out.at_step)
    out.ok, out.phases, out.nodes_after = error is None, phases, len(la.active)
    out.message = error or f"{out.from_layout} -> {out.to_layout}, {len(before)} -> {out.nodes_after} nodes " \
                           f"(live, at step {out.at_step}, {time.perf_counter() - t0:.2f} s)"
    la.log(out.message)
    la.outcomes.append(out)
    return out
