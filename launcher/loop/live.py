"""Migrations of a live-mode job whose program uses the public runtime API (launcher.runtime).

Such a model is known to the launcher only as "generic": the workers plan and move its state
themselves from per-rank manifests built on the meta device (migrate.manifest, migrate.reshard).
The launcher picks the layout and devices, starts workers on new nodes, posts one `reshard` event
that applies at an agreed step boundary, waits for every participant, records the rank map and
the migration, and gives the nodes that left back. Ranks are placed by the ETC planner
(migrate.plan.place) over the byte cost of the workers' state manifests. A worker's death is
recovered from like the reference worker's (launcher.loop.launcher.on_failure): an urgent `reshard` that
names the failed devices when the DP replicas left cover the state (checked here, purely, with
migrate.reshard.plan_transfers), else a restore from the job's safety checkpoint.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from launcher.loop.outcome import release_departed

if TYPE_CHECKING:
    from launcher.loop.launcher import Launcher


#: the most devices whose layouts are enumerated up front (shapes) for a job without --layouts
MAX_SHAPE_DEVICES = 1024


def known_model(la: "Launcher"):
    """The job's ModelSpec when its program is the reference worker (python -m launcher.worker, read from
    its model flags as options do), else None: a model only the workers know."""
    from launcher.options import model_from_command

    return la.opts.model if la.opts.model is not None else model_from_command(la.opts.command)


def choose(la: "Launcher", devices: int):
    """The layout on `devices` devices: --layouts (any PP x TP x DP: the workers build their stages and
    manifests themselves), each checked against the job's ModelSpec when the launcher knows it (a layout
    the model cannot take is refused with the reason, before anything moves: launcher.policy.layouts); without
    --layouts every grid the model takes, or pure DP for a model the launcher does not know."""
    from launcher.policy.layouts import choose_layout
    from migrate.layout import ParallelConfig

    allowed, model = list(la.opts.layouts), la.model
    if not allowed and model is None:
        return ParallelConfig(dp=devices)
    return choose_layout(devices, la.tp_fit, allowed, model)


def shape(layout) -> str:
    """What a layout's state manifests depend on: its pipeline and TP sizes (not DP: replicas)."""
    return f"pp{layout.pp}tp{layout.tp}"


def shapes(la: "Launcher") -> list[str]:
    """Every layout shape the job may run (control.KEY_SHAPES: the workers offer their manifests for these):
    those of --layouts, or, for the reference worker without --layouts, of every layout the policy picks
    on 1 to the job's most devices."""
    from launcher.policy.layouts import choose_layout
    from migrate.layout import LayoutError

    out = {shape(c) for c in la.opts.layouts} | {"pp1tp1"}
    model = known_model(la)
    if model is not None and not la.opts.layouts:
        largest = max((la.devices_on([n]) for n in la.alloc), default=la.gpn)
        for d in range(1, min(la.opts.max_nodes * largest, MAX_SHAPE_DEVICES) + 1):
            try:
                out.add(shape(choose_layout(d, la.tp_fit, (), model)))
            except LayoutError:
                continue
    return sorted(out)


def class_manifests(la: "Launcher", layout) -> list:
    """The manifest of each class (pp rank * tp + tp rank) of `layout`, as the workers offered them
    (launcher.runtime.join, for the shapes of control.KEY_SHAPES)."""
    from migrate.layout import LayoutError
    from migrate.manifest import Manifest

    spec = la.ctl.model() or {}
    got = spec.get("manifests", {}).get(shape(layout))
    if got is None:
        raise LayoutError(f"the workers offered no state manifests for {shape(layout)}")
    return [Manifest.from_list(m) for m in got]


def rank_manifests(la: "Launcher", layout) -> list:
    """One manifest per rank of `layout` (DP replicas hold their class's)."""
    classes = class_manifests(la, layout)
    return [classes[layout.coords(r)[0] * layout.tp + layout.coords(r)[2]] for r in range(layout.world_size)]


def placement(la: "Launcher", layout, prev, target: list[str], failed=frozenset(), unusable=frozenset()):
    """Where the ranks of `layout` go on the nodes `target`: the ETC placement (migrate.plan.place) over the
    byte cost of the state manifests (migrate.manifest.class_cost), with --placement's rule."""
    from migrate.manifest import Manifest, class_cost
    from migrate.plan import place
    from migrate.topology import Topology

    cost = class_cost(class_manifests(la, layout), class_manifests(la, prev.layout) + [Manifest(())])
    outside = {d.id for d in la.topology.devices if d.node not in set(target)}
    placed = place(layout, cost, prev, Topology(la.topology.devices, frozenset(target)), frozenset(failed), True,
                   la.opts.placement, frozenset((set(unusable) | outside) - set(failed)))
    return placed.devices


def plan_bytes(la: "Launcher", old, new, failed) -> dict:
    """What the move costs, as `elastic plan` reports an ETC plan (pure): bytes_moved (crossing between
    processes), bytes_state_total (one replica of the new layout's state) and bytes_checkpoint (a save
    and load through storage instead: one replica written, every new rank's share read back).
    ManifestError when some piece of the new layout's state has no surviving holder."""
    from migrate.manifest import Manifest
    from migrate.reshard import plan_transfers, transfer_bytes

    old_ms = [Manifest(()) if d in set(failed) else m for d, m in zip(old.devices, rank_manifests(la, old.layout))]
    same = {r: old.devices.index(d) for r, d in enumerate(new.devices) if d in old.devices and d not in set(failed)}
    new_ms = rank_manifests(la, new.layout)
    transfers = plan_transfers(old_ms, new_ms, same)
    entries = {id(m): m.by_fqn() for m in new_ms}  # DP replicas share their class's manifest
    moved = sum(transfer_bytes(t, entries[id(new_ms[t.dst])][t.fqn]) for t in transfers if same.get(t.dst) != t.src)
    # every piece once (a TP-replicated one, e.g. a layer norm, is in every TP rank's manifest)
    total = sum(e.nbytes for e in {e for m in class_manifests(la, new.layout) for e in m.entries})
    return {"bytes_moved": moved, "bytes_state_total": total, "bytes_checkpoint": total * (1 + new.layout.dp)}


def move(la: "Launcher", target: list[str], trigger: str, failed=(), ready_timeout: float | None = None,
         note: str = ""):
    """Move the job onto the nodes `target` with the next layout (a recovery when `failed` devices died:
    urgent, every piece from a survivor); one recorded Outcome."""
    from launcher.loop.outcome import MigrationFailed, Outcome, TrainingEnded, Transaction
    from migrate.layout import LayoutError
    from migrate.manifest import ManifestError
    from migrate.topology import RankMap

    target = [n for n in la.alloc if n in set(target)]
    before, old = la.active, la.current
    failed = sorted(failed)
    unusable = set(la.lost) - set(failed)
    t_plan = time.perf_counter()
    try:
        avail = la.devices_on(target) - len([d for d in set(failed) | unusable
                                             if la.topology.devices[d].node in target])
        layout = choose(la, avail)
        new = RankMap(layout, placement(la, layout, old, target, failed, unusable))
        cost = plan_bytes(la, old, new, failed)
    except (LayoutError, ManifestError) as exc:
        return Transaction(la, trigger).refuse(f"no plan: {exc}")
    plan_s = time.perf_counter() - t_plan
    out = Outcome(trigger, False, "", from_layout=str(old.layout), to_layout=str(layout),
                  nodes_before=len(before), nodes_after=len(before), bytes_checkpoint=cost["bytes_checkpoint"])
    new_nodes = [n for n in target if n not in la.handles]
    leaving = [n for n in before if n not in target]
    mid = la.db.start_migration(la.job_id, out.from_layout, out.to_layout, trigger,
                                {"generic": True, "from": out.from_layout, "to": out.to_layout, "nodes": target,
                                 "failed": failed, "placement": list(new.devices), **cost,
                                 "plan_ms": round(plan_s * 1000, 3)}, la.db.fragmentation(la.job_id))
    out.migration_id = mid
    e = la.epoch + 1
    t0 = time.perf_counter()
    try:
        if new_nodes:
            la.start_nodes(new_nodes, e)
            la.wait_ready(new_nodes, ready_timeout, note)
        parts = sorted((set(old.devices) - set(failed)) | set(new.devices))
        la.epoch = e
        la.ctl.post({"epoch": e, "kind": "reshard", "participants": parts, "failed": failed, "urgent": bool(failed),
                     "release_early": la.opts.release_early,
                     "prev": {"layout": str(old.layout), "devices": list(old.devices)},
                     "curr": {"layout": str(layout), "devices": list(new.devices)},
                     "exit_ok": sorted(d for n in leaving for d in la.node_devices(n)),
                     "exit_fail": sorted(d for n in new_nodes for d in la.node_devices(n))})
        la.log(f"event {e}: {out.from_layout} -> {out.to_layout} on {','.join(target)} ({trigger})")
        results = la.check_results(la.wait_results(e, parts))
    except MigrationFailed as exc:
        for n in new_nodes:
            h = la.handles.pop(n, None)
            if h is not None:
                h.kill()
        ended = isinstance(exc, TrainingEnded)  # declined: the old layout's workers have exited
        out.message = str(exc) if ended else f"migration failed: {exc}"
        la.db.finish_migration(mid, exc.status, cost["bytes_moved"], out.bytes_checkpoint, None, {"plan": plan_s},
                               error=out.message)
        la.log(out.message)
        la.outcomes.append(out)
        if not ended:
            la.resume_old(failed)
        return out
    phases = {k: max(r.get("phases", {}).get(k, 0.0) for r in results.values())
              for k in ("build_groups", "execute", "rebuild", "other")}
    phases["plan"] = plan_s
    out.marks = {d: r.get("marks", {}) for d, r in results.items()}  # launcher.loop.timeline (elastic bench --explain)
    out.worlds = (la.world, f"w{e}")
    la.pauses.add(mid, la.world, f"w{e}", out)
    la.current, la.world = new, f"w{e}"
    la.db.record_rank_map(la.job_id, la.epoch_base + e, str(layout), la.entries(new))
    la.db.update_job(la.job_id, layout=str(layout))
    la.record_survival()
    for n in leaving:
        la.reap(n)
    error, notes = release_departed(la, leaving, mid)
    steps = {r["step"] for r in results.values() if r.get("step") is not None}
    # the agreed step boundary (launcher.wire.control.agree_at); an urgent recovery applies at once, at the
    # step the survivors kept
    at = None if failed else la.ctl.at(e)
    out.at_step = at if at is not None else min(steps) if steps else None
    out.bytes_moved = sum(r.get("bytes_moved", 0) for r in results.values())
    # every message's digests compared at both ends (migrate.reshard.execute verify=True; a
    # mismatch anywhere fails every participant, so a committed move verified is bit-exact)
    out.bit_exact = all(r.get("verified") for r in results.values())
    la.db.finish_migration(mid, "succeeded", out.bytes_moved, out.bytes_checkpoint, out.bit_exact, phases, error=error,
                           fragmentation_after=la.db.fragmentation(la.job_id), at_step=out.at_step)
    out.ok, out.phases, out.nodes_after = error is None, phases, len(la.active)
    out.message = error or f"{out.from_layout} -> {out.to_layout}, {len(before)} -> {out.nodes_after} nodes " \
                           f"(live, at step {out.at_step}, {sum(r.get('units_verified', 0) for r in results.values())} " \
                           f"pieces verified, {time.perf_counter() - t0:.2f} s)"
    for note in notes:
        out.message += "; " + note
    la.log(out.message)
    la.outcomes.append(out)
    return out
