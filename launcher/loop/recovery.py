"""Workers of a live-mode job died: move onto the survivors from the DP replicas left, or, where no
replica covers the lost state, restart every worker from the job's safety checkpoint.

A worker's death fails its device; the whole node fails only when it is gone (every worker of it ended:
its step ended). A restore is recorded as a migration with the committed steps lost.
"""
from __future__ import annotations

import time
from pathlib import Path

from launcher.loop.outcome import MigrationFailed, Outcome
from launcher.loop.workers import exit_codes
from launcher.policy.survival import covered
from launcher.wire.folders import latest_checkpoint
from migrate.layout import LayoutError
from migrate.topology import RankMap


def recover(mode, dead: dict[int, int]) -> Outcome:
    """Recover from `dead` (device -> exit code); deaths that come while recovering (the rest of a node
    going down) are recovered from in turn. Returns the last Outcome."""
    mode.ctl.abort_world(mode.world)  # survivors abandon the step in flight at once
    time.sleep(0.3)  # workers killed together (a whole node) all show up in one recovery
    dead = {**dead, **mode.workers.dead()}
    for _ in range(len(mode.holdings.topology.devices)):
        out = on_failure(mode, dead)
        dead = mode.workers.dead()
        if out.ok or not dead or not mode.workers.handles:
            break
    return out


#: the exit status recorded for the workers of a node found gone (they were never seen to end): SIGKILL's
NODE_LOST_RC = 137


def lose_nodes(mode, gone: dict[str, str]) -> Outcome:
    """Whole nodes found gone (launcher.loop.probe: node -> what showed it): their workers count as dead,
    the backend forgets the nodes (never used again, out of the allocation), then `recover`."""
    dead: dict[int, int] = {}
    for node, why in gone.items():
        mode.recorder.log(f"{node} is gone ({why}): its workers are lost with it")
        mode.recorder.audit("failure", f"{node} lost: {why}")
        dead.update({d: NODE_LOST_RC for d in mode.holdings.node_devices(node) if d not in mode.workers.lost})
        mode.workers.kill([node])
        for note in mode.workers.backend.forget(node):
            mode.recorder.log(note)
            mode.recorder.audit("failure", note)
    return recover(mode, dead)


def on_failure(mode, dead: dict[int, int]) -> Outcome:
    """Re-plan from the surviving replicas, or restore from the safety checkpoint."""
    workers, holdings, rec = mode.workers, mode.holdings, mode.recorder
    rec.log(f"workers {sorted(dead)} died: {exit_codes(dead)}; {workers.log_hint(dead)}")
    hit = sorted({holdings.node_of(d) for d in dead})
    gone = [n for n in hit if workers.node_gone(n)]
    workers.kill(gone)
    for n in gone:
        rec.node_state(n, "failed")
    for d in sorted(d for d in dead if holdings.node_of(d) not in gone):
        workers.lost.add(d)
        rec.audit("failure", f"device {d} on {holdings.node_of(d)} failed (its worker died); the node stays")
    cur = mode.current
    failed = [d for d in cur.devices if d in workers.lost or holdings.node_of(d) not in workers.handles]
    keep = list(workers.active)
    if not keep:
        return rec.refuse(_outcome(mode), "no node left")
    if mode.opts.checkpoint_every and not covered(cur.layout, cur.devices, failed):
        found = latest_checkpoint(mode.ckpt_dir)
        if found and mode.restores >= mode.opts.max_restarts:
            return rec.refuse(_outcome(mode), f"workers {sorted(dead)} kept failing: --max-restarts "
                              f"{mode.opts.max_restarts} is used up by restores from the safety checkpoint; raise "
                              f"--max-restarts or fix the worker, then resume from {found[0]} with "
                              f"`elastic-launch --resume`")
        if found:
            mode.restores += 1
            return restore(mode, keep, *found)
        rec.log(f"no complete safety checkpoint in {mode.ckpt_dir} yet")
    return mode.migrate_to(keep, "failure", failed=failed)


def _outcome(mode, trigger: str = "failure") -> Outcome:
    n = len(mode.workers.active)
    return Outcome(trigger, False, "", from_layout=str(mode.current.layout), nodes_before=n, nodes_after=n)


def restore(mode, keep: list[str], path: str, step: int) -> Outcome:
    """Restart the workers on the nodes `keep` from the safety checkpoint of `step` (a failure the
    replicas cannot cover). Recorded as a migration with the committed steps lost."""
    workers, holdings, rec = mode.workers, mode.holdings, mode.recorder
    out = _outcome(mode)
    lost = max(mode.max_step() - step, 0)
    workers.kill_all()  # the survivors hold an incomplete state: start over from the checkpoint
    try:
        layout = holdings.choose(holdings.devices_on(keep))
    except LayoutError as exc:
        return rec.refuse(out, f"no layout for the nodes left: {exc}")
    devices = tuple(d for n in keep for d in holdings.node_devices(n))[:layout.world_size]
    out.to_layout = str(layout)
    rec.begin(out, {"restore_from": path, "step": step})
    e = mode.epoch + 1
    t0 = time.perf_counter()
    workers.lost -= {d for n in keep for d in holdings.node_devices(n)}  # every worker of `keep` starts afresh
    try:
        mode.ctl.forget_workers([d for n in keep for d in holdings.node_devices(n)], step)
        mode.start_nodes(keep, e)
        workers.wait_ready(mode.ctl, keep, mode.opts.ready_timeout)
        mode.post({"kind": "start", "layout": str(layout), "devices": list(devices), "checkpoint": path,
                   "urgent": True})
        mode.results(e, list(devices))
    except MigrationFailed as exc:
        return rec.failed(out, f"restore from checkpoint at step {step} failed: {exc}", at_step=step)
    mode.pauses.add(out.migration_id, mode.world, f"w{e}", out)
    mode.current, mode.world = RankMap(layout, devices), f"w{e}"
    rec.rank_map(e, out.to_layout, holdings.entries(mode.current), update_job=False)
    mode.record_survival()
    out.ok, out.at_step, out.nodes_after = True, step, len(workers.active)
    out.phases = {"rebuild": time.perf_counter() - t0}
    out.message = f"restored from checkpoint at step {step}: {lost} steps lost"
    size = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    rec.succeeded(out, checkpoint=size, error=out.message, steps_lost=lost)
    rec.log(f"{out.from_layout} -> {out.to_layout}: {out.message}")
    return rec.keep(out)
