"""One worker's part in a reshard event: planning and allocating ahead while the old layout trains, then,
inside the pause, moving the state to the new layout (migrate.reshard, by manifest) and committing
all-or-nothing (Control.commit_event). A recovery (`failed` devices) takes every piece from a survivor."""
from __future__ import annotations

import os
import time
from typing import Protocol

from launcher.runtime import faults as runtime_faults
from launcher.runtime.build import Builder
from launcher.runtime.collector import CollectorHold
from launcher.runtime.sockets import cut_collective_sockets
from launcher.runtime.state import dumps, export_local, loads
from launcher.runtime.worlds import Worlds
from launcher.wire.control import Control, WorldAborted


class Worker(Protocol):
    """What a migration uses of the worker taking part (launcher.runtime.job.Job): the migration hands
    its state over and rebuilds it, the worker owns it between events."""

    device: int
    ctl: Control
    worlds: Worlds
    builder: Builder
    timeout: float
    fault: tuple[str, int | None] | None
    model: object
    optimizer: object
    broken: bool
    step: int
    carried: dict
    migrations: int
    _kept: dict | None
    _collector: CollectorHold

    def log(self, msg: str) -> None: ...

    def _release(self) -> dict | None: ...

    def _enter(self, layout: str, devices: list[int], world: str, local: dict | None, keep: bool = False) -> float: ...


class Migration:
    """The reshard events of one worker (its state, world and control-plane connection are the worker's)."""

    def __init__(self, job: Worker) -> None:
        self.job = job
        self._prepared: dict[int, dict] = {}  # event -> {"targets", "staging", "local", "transfer"} made ahead
        self._plans: dict[int, tuple] = {}  # event -> this process's plan of that reshard (the latest only)

    def prepare(self, ev: dict) -> None:
        """Allocate (and touch) the new local tensors this worker will receive in reshard event `ev`, while
        the old layout still trains or, on a joining worker, while it waits for the old layout's last
        step: receiving into memory already mapped is several times faster on CPU (facts.md). With
        --release-early only a joining worker does (plan_targets). The transfer layer's staging buffers
        (strided and packed pieces) are made here too, in both modes. Every participant plans the reshard
        here, a worker that only sends too (a shrink's leavers planned it inside the pause: 2.1 s of the
        6.6 s pause of pp6tp4 -> pp4tp2, 16 of them on 2 cores), and builds its whole transfer over its
        state of now (migrate.reshard.prepare_transfer: views cut, messages bound and described), which
        the pause runs if the tensors are still the same ones (in-place optimizer steps keep them)."""
        from migrate.reshard import (allocate_staging, allocate_targets, plan_local, plan_staging, plan_targets,
                                     prepare_transfer)

        job, e = self.job, ev["epoch"]
        if ev.get("kind") != "reshard" or job.device not in ev["participants"]:
            return
        _alive, old_rank, new_rank, old_ms, new_ms, _same, transfers = self.plan(ev)
        if e in self._prepared:
            return
        early = bool(ev.get("release_early"))
        old_m = old_ms[old_rank] if old_rank is not None else None
        new_m = new_ms[new_rank] if new_rank is not None else None
        targets = allocate_targets(plan_targets(transfers, old_rank, new_rank, old_m, new_m, early))
        staging = allocate_staging(plan_staging(transfers, old_rank, new_rank, old_m, new_m, early))
        local = plan_local(transfers, old_rank, new_rank, old_m, new_m)
        self._prepared[e] = {"targets": targets, "staging": staging, "local": local}
        if early and old_rank is not None and new_rank is not None:
            return  # built in the pause: building it allocates the new tensors it copies into, memory comes first
        if old_rank is None:
            held = {}
        elif job.model is not None:
            held = export_local(job.model, job.optimizer)
        elif job._kept is not None:
            held = job._kept["local"]
        else:
            return
        try:  # over the tensors of now: the pause moves the same ones when steps update them in place
            self._prepared[e]["transfer"] = prepare_transfer(transfers, old_rank, new_rank, held, old_m, new_m,
                                                             early, targets=targets, staging=staging, local=local)
        except KeyError as exc:  # the old state lacks a piece for now (no optimizer step yet): built in the pause
            job.log(f"event {e}: transfer not prepared ahead ({exc!r} not held yet)")

    def plan(self, ev: dict) -> tuple:
        """This process's view of reshard event `ev` (pure): the surviving old ranks, its old and new rank
        (None: none), the old and new layouts' manifests (a failed rank's empty), which old rank each new
        rank already is (same process), and the transfers it sends or receives (of every process's
        migrate.reshard.plan_transfers: the rest it would only skip, pass after pass, inside the pause).
        Planned once per event: prepare plans ahead while the old layout trains, and the reshard reuses
        it inside the pause."""
        if ev["epoch"] not in self._plans:
            self._plans = {ev["epoch"]: self._plan_now(ev)}
        return self._plans[ev["epoch"]]

    def _plan_now(self, ev: dict) -> tuple:
        from migrate.manifest import Manifest
        from migrate.reshard import plan_transfers

        device, manifests = self.job.device, self.job.builder.manifests
        prev, curr = ev["prev"], ev["curr"]
        failed = set(ev.get("failed", []))
        alive = [r for r, d in enumerate(prev["devices"]) if d not in failed]
        old_rank = prev["devices"].index(device) if device in prev["devices"] and device not in failed else None
        new_rank = curr["devices"].index(device) if device in curr["devices"] else None
        old_ms = [m if r in alive else Manifest(()) for r, m in enumerate(manifests(prev["layout"]))]
        new_ms = manifests(curr["layout"])
        same = {r: prev["devices"].index(d) for r, d in enumerate(curr["devices"])
                if d in prev["devices"] and d not in failed}
        mine = [t for t in plan_transfers(old_ms, new_ms, same)
                if t.src == old_rank or t.dst == new_rank]  # a rank of None matches none
        return alive, old_rank, new_rank, old_ms, new_ms, same, mine

    def run(self, ev: dict) -> bool:
        """Take part in reshard event `ev`; False when this worker ends here.

        Reports what the reference worker reports, for `elastic history` and `elastic bench --explain`
        (launcher.loop.timeline): the phases build_groups (forming process groups), execute (the transfer),
        other (exporting the state, exchanging the registered objects) and rebuild (the model and
        optimizer on the new layout), and the marks boundary, moved, agreed, built besides the worlds'.
        The migration world's members are the new layout's devices in rank order, then the ones that
        leave: a grow's migration world is then the new training world, and a shrink's the old one, so
        either is kept instead of formed anew when its group is healthy (launcher.runtime.worlds keep=True)."""
        job = self.job
        e, parts, curr = ev["epoch"], ev["participants"], ev["curr"]
        if job.device not in parts:
            return job.device not in ev.get("exit_ok", [])
        job.ctl.mark("boundary")
        if job.device not in ev["prev"]["devices"]:  # a joiner plans and allocates ahead, before it waits
            self.prepare(ev)  # for the old layout's last step: no phase of the pause counts it
        job._collector.hold()  # until the new layout's first step committed (launcher.runtime.collector)
        t0 = time.perf_counter()
        healthy = job.model is not None and not job.broken and not ev.get("urgent")
        plan = self.plan(ev)
        old_rank = plan[1]
        held = job._release()
        if old_rank is not None:
            if held is None:
                raise RuntimeError(f"device {job.device}: old rank {old_rank} of event {e} holds no state")
            job.ctl.hand_over(e, old_rank, dumps(held["extras"]), held["step"])
        self.prepare(ev)  # done while the old layout trained, but for an urgent recovery
        prepared = self._prepared.pop(e, {})
        members = list(curr["devices"]) + [d for d in parts if d not in curr["devices"]]
        other = time.perf_counter() - t0
        try:
            result, t1, t2 = self._move(ev, plan, members, healthy, held, prepared)
        except Exception as exc:  # nothing committed: every participant keeps its old state
            return self._failed(ev, plan, held, exc)
        return self._land(ev, plan, result, other, t2 - t1)

    def _move(self, ev: dict, plan: tuple, members: list[int], healthy: bool, held: dict | None,
              prepared: dict) -> tuple:
        """The transfer in the migration world, up to its commit; (result, start, end of the transfer)."""
        from migrate.reshard import execute

        job, ctl, e = self.job, self.job.ctl, ev["epoch"]
        alive, old_rank, new_rank, old_ms, new_ms, _same, transfers = plan
        prev, curr = ev["prev"], ev["curr"]
        job.worlds.join(f"m{e}", members, job.device, job.timeout, abort_key=ctl.commit_key(e), keep=healthy)
        t1 = time.perf_counter()
        # $ELASTIC_FAULT round:N: SIGKILL before transfer window N (round 0: before the first message)
        later = job.fault is not None and job.fault[0] == "round" and bool(job.fault[1])
        if not later:
            runtime_faults.die_at(job.fault, "round", 0, job.log)
        on_window = (lambda i: runtime_faults.die_at(job.fault, "round", i, job.log)) if later else None
        rank_of = dict(zip(members, job.worlds.ranks(members)))
        cpu0 = os.times()
        procs_old = [rank_of[d] if r in alive else -1 for r, d in enumerate(prev["devices"])]
        procs_new = [rank_of[d] for d in curr["devices"]]
        result = execute(transfers, old_rank, new_rank, held["local"] if old_rank is not None else {},
                         old_ms[old_rank] if old_rank is not None else None,
                         new_ms[new_rank] if new_rank is not None else None, procs_old, procs_new,
                         release_early=bool(ev.get("release_early")), targets=prepared.get("targets"),
                         verify=True, on_window=on_window, staging=prepared.get("staging"),
                         local=prepared.get("local"), prepared=prepared.get("transfer"))
        t2 = time.perf_counter()
        ctl.mark("moved")
        st = result.stats
        built = "built ahead" if result.built_ahead else "built in the pause"
        job.log(f"event {e}: sent {st.bytes_sent / 1e6:.1f} MB, received {st.bytes_received / 1e6:.1f} MB in "
                f"{st.messages} messages ({st.cma_bytes / 1e6:.1f} MB read across processes' memory), "
                f"{st.windows} windows ({built}); transfer {result.phases.get('transfer', 0):.3f} s, "
                f"verify {result.phases.get('verify', 0):.3f} s (digests of what landed {st.final_digest_s:.3f} s), "
                f"cpu user {os.times().user - cpu0.user:.3f} s, sys {os.times().system - cpu0.system:.3f} s")
        runtime_faults.die_at(job.fault, "commit", None, job.log)
        if not ctl.commit_event(e, len(ev["participants"])):
            raise runtime_faults.StepAborted("another participant failed or the launcher vetoed the commit")
        runtime_faults.die_at(job.fault, "committed", None, job.log)
        ctl.mark("agreed")
        return result, t1, t2

    def _failed(self, ev: dict, plan: tuple, held: dict | None, exc: Exception) -> bool:
        """The migration did not commit: veto it, fail the peers still in the transfer, keep the old state."""
        job, e = self.job, ev["epoch"]
        old_rank, old_ms = plan[1], plan[3]
        job.ctl.veto_event(e)
        cut_collective_sockets(job.ctl.port)  # peers still in a transfer with us fail now
        whole = old_rank is not None and set(held["local"]) == set(old_ms[old_rank].by_fqn())
        job._kept = held if whole else None  # release-early may have dropped verified pieces already
        msg = f"device {job.device}: migration failed ({type(exc).__name__}: {str(exc)[:200]}); old layout kept"
        if old_rank is not None and not whole:
            msg += " by the other replicas (this device released part of its old state early)"
        job.log(msg)
        job.ctl.set_result(e, job.device, {"ok": False, "error": msg, "phases": {}})
        return job.device not in ev.get("exit_fail", [])

    def _land(self, ev: dict, plan: tuple, result, other: float, transfer_s: float) -> bool:
        """The migration committed: report it, and train on the new layout (or leave, or stand by)."""
        from migrate.reshard import transfer_bytes

        job, ctl, e = self.job, self.job.ctl, ev["epoch"]
        alive, _old_rank, new_rank, _old_ms, new_ms, same, transfers = plan
        curr = ev["curr"]
        # what this process received from others (the launcher adds the participants' figures up)
        mine = new_ms[new_rank].by_fqn() if new_rank is not None else {}
        moved = sum(transfer_bytes(t, mine[t.fqn]) for t in transfers if t.dst == new_rank and same.get(t.dst) != t.src)
        groups = ctl.formed_s(f"m{e}")
        # execute: the transfer; the digests' comparison (every message verified at both ends) is `other`
        phases = {"build_groups": groups, "execute": result.phases.get("transfer", transfer_s),
                  "other": other + result.phases.get("verify", 0.0)}
        verified = {"units_verified": result.units_verified, "verified": True}
        if new_rank is None:
            job.worlds.leave()
            ctl.set_result(e, job.device, {"ok": True, "step": None, "bytes_moved": moved, "phases": phases,
                                           **verified})
            return job.device not in ev.get("exit_ok", [])  # on a node that stays: standby
        t3 = time.perf_counter()
        objects, job.step = ctl.handed_over(e, same.get(new_rank, alive[0]))
        extras = loads(objects)
        for k, obj in job.carried.items():
            obj.load_state_dict(extras[k])
        phases["other"] += time.perf_counter() - t3
        report = {"ok": True, "step": job.step, "bytes_moved": moved, **verified}
        t4 = time.perf_counter()
        try:
            groups_w = job._enter(curr["layout"], curr["devices"], f"w{e}", result, keep=True)
        except WorldAborted:  # committed, but a new-layout peer died before training: the launcher recovers
            ctl.set_result(e, job.device, {**report, "phases": phases})
            raise
        ctl.mark("built")
        job.migrations += 1
        job.came_by = _which(ev)
        phases.update(build_groups=groups + groups_w, rebuild=time.perf_counter() - t4 - groups_w)
        ctl.set_result(e, job.device, {**report, "phases": phases})
        return True


def _which(ev: dict) -> str:
    """A reshard event in a user's words: "the grow pp1tp2dp1 -> pp1tp2dp2"."""
    before, after = len(ev["prev"]["devices"]), len(ev["curr"]["devices"])
    kind = "recovery" if ev.get("failed") else "grow" if after > before else "shrink" if after < before else "move"
    return f"the {kind} {ev['prev']['layout']} -> {ev['curr']['layout']}"
