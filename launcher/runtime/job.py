"""One worker's side of a live-mode job: join the control plane, train, and take part in every
migration at the step boundary the launcher posts (the public API is launcher.runtime)."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping

from launcher.wire import control as C
from launcher.runtime import ckpt as runtime_ckpt
from launcher.runtime import faults as runtime_faults
from launcher.runtime.collector import CollectorHold
from launcher.runtime.layout import Layout, device_mesh, keep_stage_blocks, parse_layout
from launcher.runtime.pipeline import Pipeline
from launcher.runtime.threads import GlooThreads, nice_from_env
from launcher.runtime.sockets import cut_collective_sockets
from migrate.cma import enabled_from_env as cma_enabled_from_env


#: what the launcher names when a joined worker never reaches the step boundary
STEP_CALL = "job.next_step()"
JOIN_CALL = "launcher.runtime.join(...)"


class Job:
    """One worker of a live-mode job (see the module docstring); made by `join`."""

    def __init__(self, ctl: C.Control, device: int, model: Callable, tp_plan: Mapping | None,
                 optimizer: Callable, state: Mapping[str, object], manifest: Callable | None = None,
                 collective_timeout: float = 120.0, local: tuple[int, int] = (0, 1)) -> None:
        self.ctl, self.device = ctl, device
        self.timeout = collective_timeout  # seconds a collective may wait for a peer
        self._local = local  # (local rank, workers per node): torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE
        self._produce = manifest  # layout -> this rank's Manifest, for a model that shards itself
        self._mcache: dict[str, list] = {}
        self._build_model, self.tp_plan, self._build_opt = model, dict(tp_plan or {}), optimizer
        self.extras = dict(state)
        self.model = self.optimizer = None
        self.layout: Layout | None = None
        self.step = 0
        self.epoch = int(os.environ.get(C.ENV_FIRST_EVENT, "0"))
        self.devices: list[int] = []
        self._at: int | None = None
        self.migrations = 0
        self.world: str | None = None  # the training world (launcher.wire.control: w<event>)
        self.broken = False  # a step failed because a peer did: wait for the launcher's recovery event
        self._committed = 0  # the last step whose optimizer update committed (launcher.runtime.faults)
        self._entered_at = 0  # the step this worker entered its current world at (_enter)
        self._collector = CollectorHold()  # the garbage collector kept out of a migration's pause
        self._gloo = GlooThreads()  # gloo's I/O threads at a low priority (launcher.runtime.threads)
        self._snap: dict = {}  # the registered objects' state at the last step boundary
        self._kept: dict | None = None  # state held while no model is built (a migration that did not commit)
        self.ckpt_dir = os.environ.get(C.ENV_CKPT_DIR) or None
        self.ckpt_every = int(os.environ.get(C.ENV_CKPT_EVERY, "0") or 0) if self.ckpt_dir else 0
        self._saved = -1  # the last step a safety checkpoint was written at
        self._prepared: dict[int, dict] = {}  # event -> {"targets", "staging", "local", "transfer"} made ahead
        self._plans: dict[int, tuple] = {}  # event -> this process's plan of that reshard (the latest only)
        self.fault = runtime_faults.fault_for(device)  # $ELASTIC_FAULT (tests)
        self.safety = runtime_ckpt.Safety(self.ckpt_dir, self.log, self.fault)  # background safety checkpoints

    def log(self, msg: str) -> None:
        print(f"[runtime dev{self.device} ev{self.epoch}] {msg}", file=sys.stderr, flush=True)

    # -- the step boundary ------------------------------------------------------------------------
    def next_step(self, until: int | None = None) -> bool:
        """Call before every step: publishes progress, applies a migration or stop that is due here.
        True: run step `job.step + 1` now; False: the job is over for this worker (exit)."""
        while True:
            live = self.model is not None and not self.broken
            if live:
                self._boundary()
                live = not self.broken
            ev = self.ctl.event(self.epoch) if live else self.ctl.wait_event(self.epoch)
            if ev is not None and live and self._at is None and not ev.get("urgent"):
                self.ctl.mark("event seen")
                self._at = self.ctl.agree_at(self.epoch, self.step)
                self.log(f"event {self.epoch} ({ev.get('kind')}) seen after step {self.step}: applies after step "
                         f"{self._at}")
                self._prepare(ev)  # while the old layout still trains, outside the pause
            if ev is not None and (not live or self._at is None or self.step >= self._at):
                self._at = None
                if not self._handle(ev):
                    self._leave()
                    return False
                continue
            if not live:
                continue
            if until is not None and self.step >= until:
                self._leave()
                return False
            self.step += 1
            return True

    @contextlib.contextmanager
    def guard(self):
        """Wrap each step's body in it: when another worker dies during the step, the step is abandoned
        here (this worker keeps the state of the last committed step, see launcher.runtime.faults)
        and the next `next_step()` waits for the launcher to recover the job. Any other error is raised."""
        try:
            yield
        except Exception as exc:
            if self.model is None or not runtime_faults.is_peer_failure(exc, self.ctl, self.world):
                raise
            self._abandon(exc)

    def report_loss(self, loss) -> None:
        """This step's loss for the job's timeline (`elastic history`, the dashboard): the launcher copies
        the latest report into the database. Call it on one rank, after the step (e.g. layout.rank == 0)."""
        self.ctl.set_loss(self.step, float(loss), self.layout.name)

    def reduce_gradients(self) -> None:
        """Average the gradients over the DP replicas (call after backward, before optimizer.step)."""
        import torch.distributed as dist

        if self.layout.dp == 1:
            return
        for p in self.model.parameters():
            if p.grad is not None:
                g = _local(p.grad)
                dist.all_reduce(g, group=self.layout.dp_group)
                g.div_(self.layout.dp)

    # -- consistent cuts and safety checkpoints -----------------------------------------------------
    def _boundary(self) -> None:
        """Between two steps: the heartbeat, the registered objects' state (to take back if the next step
        fails), and a safety checkpoint when one is due (written in the background: runtime_ckpt.Safety).
        gloo's I/O threads of process groups made since the last boundary are lowered (runtime_threads)."""
        self._gloo.lower()
        self.ctl.set_step(self.device, self.step)
        if self.step > self._entered_at:  # a step committed in this world: the pause is over
            self._collector.release()
            if self.ctl.retired:  # tear the old world down
                self.ctl.drop_retired()
        self._snap = self._extras_state()
        self.safety.poll()
        if self.ckpt_every and self.step and self.step % self.ckpt_every == 0 and self._saved != self.step:
            self._saved = self.step
            with self.guard():
                self.safety.start(self.step, self.layout.rank, _state_views(self.model, self.optimizer),
                                  self._my_manifest(), self.layout.dp_tp_mesh, self.extras)

    def _vote(self) -> None:
        """The optimizer's pre-step hook: apply this step only if every rank of the world does."""
        if self._committed == self.step:
            return  # a second optimizer.step() in the same step
        runtime_faults.die_at(self.fault, "step", self.step, self.log)
        if not self.ctl.commit_step(self.world, self.step - 1, self.layout.world_size):
            raise runtime_faults.StepAborted(f"step {self.step} abandoned: a worker of {self.world} failed")
        self._committed = self.step
        if self.layout.rank == 0 and self.step > 1:  # everybody is past the previous vote: drop its keys
            for key in (f"c/{self.world}/{self.step - 2}", f"c/{self.world}/{self.step - 2}/n"):
                self.ctl.store.delete_key(key)

    def _abandon(self, exc: BaseException) -> None:
        """A peer failed this step: fail every peer still waiting on us, keep the last committed state."""
        self.log(f"step {self.step} failed ({type(exc).__name__}: {str(exc)[:200]}); state kept at step "
                 f"{self._committed}, waiting for recovery")
        self.broken = True
        try:
            self.ctl.abort_world(self.world)
        except Exception:
            pass
        cut_collective_sockets(self.ctl.port)
        if self.step != self._committed:  # the update was not applied: back to the boundary before it
            self.step = self._committed
            for k, obj in self.extras.items():
                obj.load_state_dict(self._snap[k])

    def _my_manifest(self):
        return self._manifests(self.layout.name)[self.layout.rank]

    def _save_checkpoint(self) -> str:
        """This rank's part of a checkpoint of the current step (every rank of the world calls it)."""
        return runtime_ckpt.save(self.ckpt_dir, _state_views(self.model, self.optimizer), self._my_manifest(),
                                 self.layout.dp_tp_mesh, self.extras, self.step, self.layout.rank)

    def _extras_state(self) -> dict:
        return {k: copy.deepcopy(v.state_dict()) for k, v in self.extras.items()}

    # -- events -----------------------------------------------------------------------------------
    def _handle(self, ev: dict) -> bool:
        kind = ev["kind"]
        self.epoch = ev["epoch"] + 1
        self.safety.settle()  # the world may change: the background checkpoint finishes (or is dropped) first
        try:
            if kind == "stop":
                return False
            if kind == "start":
                return self._start(ev)
            if kind == "reshard":
                return self._reshard(ev)
            if kind == "resume":  # a migration did not commit: train on the old layout again
                return self._resume(ev)
            if kind == "suspend":
                return self._suspend(ev)
            if kind == "exit":
                return self.device not in ev["devices"]
        except C.WorldAborted as exc:  # a member died before the world formed: the launcher recovers
            self.log(f"{exc}; waiting for recovery")
            return True
        raise RuntimeError(f"event {kind!r} is not supported in live mode by launcher.runtime")

    def _start(self, ev: dict) -> bool:
        if self.device not in ev["devices"]:
            return True  # standby until a migration brings this device in
        self._enter(ev["layout"], ev["devices"], f"w{ev['epoch']}", None)
        path = ev.get("checkpoint")
        if path:
            t0 = time.perf_counter()
            try:
                self.step = self._committed = self._saved = runtime_ckpt.load(
                    path, _state_views(self.model, self.optimizer), self._my_manifest(), self.layout.dp_tp_mesh,
                    self.extras)
            except runtime_ckpt.failures() as exc:
                self.ctl.set_result(ev["epoch"], self.device, {"ok": False, "error": f"device {self.device}: "
                                    f"loading {path} failed: {type(exc).__name__}: {exc}", "phases": {}})
                raise
            self.ctl.set_result(ev["epoch"], self.device, {"ok": True, "step": self.step,
                                                           "phases": {"rebuild": time.perf_counter() - t0}})
            self.log(f"training as rank {self.layout.rank} of {self.layout.name} from {path} at step {self.step}")
        return True

    def _resume(self, ev: dict) -> bool:
        if self.device not in ev["devices"]:
            return True
        held = self._release()
        self.step = held["step"]
        for k, obj in self.extras.items():
            obj.load_state_dict(held["extras"][k])
        self._enter(ev["layout"], ev["devices"], f"w{ev['epoch']}", held["local"])
        self.log(f"resumed as rank {self.layout.rank} of {self.layout.name} at step {self.step}")
        return True

    def _suspend(self, ev: dict) -> bool:
        """Write the state once at the agreed boundary (every training rank its part), then end."""
        if self.model is None or self.broken or self.device not in self.devices:
            return False
        result: dict = {"ok": False, "step": self.step, "phases": {}}
        t0 = time.perf_counter()
        try:
            if not self.ckpt_dir:
                raise RuntimeError(f"${C.ENV_CKPT_DIR} is unset")
            path = self._save_checkpoint()
            result.update(ok=True, path=path, phases={"other": time.perf_counter() - t0})
            self.log(f"suspended: state of step {self.step} written to {path}")
        except runtime_ckpt.failures() as exc:
            result["error"] = f"device {self.device}: checkpoint of step {self.step} failed: {type(exc).__name__}: {exc}"
            self.log(result["error"])
        self.ctl.set_result(ev["epoch"], self.device, result)  # the launcher reads the folder once all reported
        return False

    def _enter(self, layout: str, devices: list[int], world: str, local: dict | None, keep: bool = False) -> float:
        """Join the layout's world, build model and optimizer there, fill them with `local` if given;
        returns the seconds spent forming process groups (the rest is the rebuild). keep=True (the
        process group this worker is in is healthy: a migration just committed in it) keeps that group
        when its members are exactly `devices` in rank order (Control.join_world), so process-group
        ranks stay the layout's ranks. WorldAborted when a member died first: `local` is kept for the
        recovery."""
        t0 = time.perf_counter()
        keep = keep and self.ctl.pg_members == list(devices)
        try:
            rank = self.ctl.join_world(world, devices, self.device, self.timeout, abort_key=f"abort/{world}", keep=keep)
        except C.WorldAborted:
            self.model = self.optimizer = None
            self._kept = None if local is None else {"local": local, "step": self.step,
                                                     "extras": self._extras_state()}
            raise
        _forget_old_meshes()
        lay = parse_layout(layout, rank, len(devices))
        lay.mesh = device_mesh(lay)
        groups_s = time.perf_counter() - t0
        # torchrun's variables for the code of this world (MASTER_* name the control-plane store)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(len(devices)), "LOCAL_RANK": str(self._local[0]),
                           "LOCAL_WORLD_SIZE": str(self._local[1]), "MASTER_ADDR": self.ctl.host,
                           "MASTER_PORT": str(self.ctl.port), "ELASTIC_VIRTUAL_RANK": str(rank),
                           "ELASTIC_LAYOUT": lay.name})
        self.model, self.optimizer = self._build(lay, local)
        self.layout, self.devices, self.world = lay, list(devices), world
        runtime_faults.install_commit(self.optimizer, self._vote)
        self.broken, self._kept, self._committed, self._saved = False, None, self.step, self.step
        self._entered_at = self.step
        return groups_s

    def _release(self) -> dict | None:
        """Drop model and optimizer; returns the state they (or a kept copy) held: local tensors, step, objects."""
        if self.model is not None:
            held = {"local": _export_local(self.model, self.optimizer), "step": self.step,
                    "extras": self._extras_state()}
        else:
            held = self._kept
        self.model = self.optimizer = None
        self._kept = None
        return held

    def _build(self, lay: Layout, local: Mapping | None = None):
        """Model and optimizer on layout `lay`, the optimizer's state created; with `local` (a migration's
        new state by FQN) holding that state. Where the model allows it (_on_meta), a migration's model
        is built on the meta device and takes the received tensors themselves as its parameters and its
        optimizer's state (_assemble): inside the pause, every rank otherwise allocated its whole state
        afresh, ran an optimizer step over it and copied every received tensor in (1.8 s of a 5.6 s
        pause, pp4tp2 -> pp4tp4 of the bench)."""
        import torch

        module = _on_meta(self._build_model, lay, self.tp_plan) if local is not None else None
        if module is not None:
            return _assemble(module, self._build_opt, local)
        module = self._build_model(lay)
        plan = _stage_plan(module, self.tp_plan)
        if lay.tp > 1 and plan:
            from torch.distributed.tensor.parallel import parallelize_module

            module = parallelize_module(module, lay.tp_mesh, plan)
        opt = self._build_opt(module.parameters())
        # create the optimizer's state now (a step with zero gradients), so it can be filled and moved
        saved = None if local is not None else {k: v.detach().clone() for k, v in module.state_dict().items()}
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if saved is None:  # a migration's state overwrites every value: nothing to restore
            _load_local(module, opt, local)
            return module, opt
        with torch.no_grad():
            for k, v in module.state_dict().items():
                _local(v).copy_(_local(saved[k]))
        for st in opt.state.values():
            for key, v in st.items():
                if hasattr(v, "zero_"):
                    _local(v).zero_()
        return module, opt

    def _class_manifests(self, layout: str) -> list:
        """The manifest of each class (pp rank * tp + tp rank) of `layout`: the stages built on the meta
        device, or the script's `manifest` producer (DP replicas hold their class's); no process needs
        to hold the layout."""
        from migrate.layout import ParallelConfig
        from migrate.manifest import layout_manifests, stage_manifests

        cfg = ParallelConfig.parse(layout)
        if self._produce is not None:
            return layout_manifests(cfg, lambda r: self._produce(parse_layout(layout, r, cfg.world_size)))
        return stage_manifests(cfg, lambda r: self._build_model(parse_layout(layout, r, cfg.world_size)),
                               self.tp_plan, _optimizer_kind(self._build_opt))

    def _manifests(self, layout: str) -> list:
        """Per-rank manifests of `layout` (no process needs to hold it)."""
        from migrate.layout import ParallelConfig

        if layout not in self._mcache:
            self._mcache[layout] = self._class_manifests(layout)
        cfg, classes = ParallelConfig.parse(layout), self._mcache[layout]
        return [classes[cfg.coords(r)[0] * cfg.tp + cfg.coords(r)[2]] for r in range(cfg.world_size)]

    def _prepare(self, ev: dict) -> None:
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

        e = ev["epoch"]
        if ev.get("kind") != "reshard" or self.device not in ev["participants"]:
            return
        _alive, old_rank, new_rank, old_ms, new_ms, _same, transfers = self._plan_reshard(ev)
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
        elif self.model is not None:
            held = _export_local(self.model, self.optimizer)
        elif self._kept is not None:
            held = self._kept["local"]
        else:
            return
        try:  # over the tensors of now: the pause moves the same ones when steps update them in place
            self._prepared[e]["transfer"] = prepare_transfer(transfers, old_rank, new_rank, held, old_m, new_m,
                                                             early, targets=targets, staging=staging, local=local)
        except KeyError as exc:  # the old state lacks a piece for now (no optimizer step yet): built in the pause
            self.log(f"event {e}: transfer not prepared ahead ({exc!r} not held yet)")

    def _plan_reshard(self, ev: dict) -> tuple:
        """This process's view of reshard event `ev` (pure): the surviving old ranks, its old and new rank
        (None: none), the old and new layouts' manifests (a failed rank's empty), which old rank each new
        rank already is (same process), and the transfers it sends or receives (of every process's
        migrate.reshard.plan_transfers: the rest it would only skip, pass after pass, inside the pause).
        Planned once per event: _prepare plans ahead while the old layout trains, and the reshard reuses
        it inside the pause."""
        if ev["epoch"] not in self._plans:
            self._plans = {ev["epoch"]: self._plan_reshard_now(ev)}
        return self._plans[ev["epoch"]]

    def _plan_reshard_now(self, ev: dict) -> tuple:
        from migrate.manifest import Manifest
        from migrate.reshard import plan_transfers

        prev, curr = ev["prev"], ev["curr"]
        failed = set(ev.get("failed", []))
        alive = [r for r, d in enumerate(prev["devices"]) if d not in failed]
        old_rank = prev["devices"].index(self.device) if self.device in prev["devices"] and self.device not in failed \
            else None
        new_rank = curr["devices"].index(self.device) if self.device in curr["devices"] else None
        old_ms = [m if r in alive else Manifest(()) for r, m in enumerate(self._manifests(prev["layout"]))]
        new_ms = self._manifests(curr["layout"])
        same = {r: prev["devices"].index(d) for r, d in enumerate(curr["devices"])
                if d in prev["devices"] and d not in failed}
        mine = [t for t in plan_transfers(old_ms, new_ms, same)
                if t.src == old_rank or t.dst == new_rank]  # a rank of None matches none
        return alive, old_rank, new_rank, old_ms, new_ms, same, mine

    def _reshard(self, ev: dict) -> bool:
        """Move the state from the old layout to the new one (migrate.reshard, by manifest); commits
        all-or-nothing (`ev/<e>/commit`). A recovery (`failed` devices) takes every piece from a survivor.

        Reports what the reference worker reports, for `elastic history` and `elastic bench --explain`
        (launcher.loop.timeline): the phases build_groups (forming process groups), execute (the transfer),
        other (exporting the state, exchanging the registered objects) and rebuild (the model and
        optimizer on the new layout), and the marks boundary, moved, agreed, built besides the worlds'.
        The migration world's members are the new layout's devices in rank order, then the ones that
        leave: a grow's migration world is then the new training world, and a shrink's the old one, so
        either is kept instead of formed anew when its group is healthy (Control.join_world keep=True)."""
        from migrate.reshard import execute, transfer_bytes

        e, parts = ev["epoch"], ev["participants"]
        prev, curr = ev["prev"], ev["curr"]
        if self.device not in parts:
            return self.device not in ev.get("exit_ok", [])
        self.ctl.mark("boundary")
        if self.device not in ev["prev"]["devices"]:  # a joiner plans and allocates ahead, before it waits
            self._prepare(ev)  # for the old layout's last step: no phase of the pause counts it
        self._collector.hold()  # until the new layout's first step committed (launcher.runtime.collector)
        t0 = time.perf_counter()
        healthy = self.model is not None and not self.broken and not ev.get("urgent")
        alive, old_rank, new_rank, old_ms, new_ms, same, transfers = self._plan_reshard(ev)
        held = self._release()
        if old_rank is not None:
            if held is None:
                raise RuntimeError(f"device {self.device}: old rank {old_rank} of event {e} holds no state")
            self.ctl.store.set(f"ev/{e}/extra/{old_rank}", _dumps(held["extras"]))
            self.ctl.store.set(f"ev/{e}/step/{old_rank}", str(held["step"]))
        self._prepare(ev)  # done while the old layout trained, but for an urgent recovery
        prepared = self._prepared.pop(e, {})
        members = list(curr["devices"]) + [d for d in parts if d not in curr["devices"]]
        release_early = bool(ev.get("release_early"))
        other = time.perf_counter() - t0
        try:
            self.ctl.join_world(f"m{e}", members, self.device, self.timeout, abort_key=f"ev/{e}/commit", keep=healthy)
            t1 = time.perf_counter()
            # $ELASTIC_FAULT round:N: SIGKILL before transfer window N (round 0: before the first message)
            later = self.fault is not None and self.fault[0] == "round" and bool(self.fault[1])
            if not later:
                runtime_faults.die_at(self.fault, "round", 0, self.log)
            on_window = (lambda i: runtime_faults.die_at(self.fault, "round", i, self.log)) if later else None
            rank_of = dict(zip(members, self.ctl.world_ranks(members)))
            cpu0 = os.times()
            procs_old = [rank_of[d] if r in alive else -1 for r, d in enumerate(prev["devices"])]
            procs_new = [rank_of[d] for d in curr["devices"]]
            result = execute(transfers, old_rank, new_rank, held["local"] if old_rank is not None else {},
                             old_ms[old_rank] if old_rank is not None else None,
                             new_ms[new_rank] if new_rank is not None else None, procs_old, procs_new,
                             release_early=release_early, targets=prepared.get("targets"), verify=True,
                             on_window=on_window, staging=prepared.get("staging"), local=prepared.get("local"),
                             prepared=prepared.get("transfer"))
            t2 = time.perf_counter()
            self.ctl.mark("moved")
            st = result.stats
            built = "built ahead" if result.built_ahead else "built in the pause"
            self.log(f"event {e}: sent {st.bytes_sent / 1e6:.1f} MB, received {st.bytes_received / 1e6:.1f} MB in "
                     f"{st.messages} messages ({st.cma_bytes / 1e6:.1f} MB read across processes' memory), "
                     f"{st.windows} windows ({built}); transfer {result.phases.get('transfer', 0):.3f} s, "
                     f"verify {result.phases.get('verify', 0):.3f} s (digests of what landed {st.final_digest_s:.3f} s), "
                     f"cpu user {os.times().user - cpu0.user:.3f} s, sys {os.times().system - cpu0.system:.3f} s")
            runtime_faults.die_at(self.fault, "commit", None, self.log)
            if not self.ctl.decide(f"ev/{e}/commit", len(parts)):
                raise runtime_faults.StepAborted("another participant failed or the launcher vetoed the commit")
            runtime_faults.die_at(self.fault, "committed", None, self.log)
            self.ctl.mark("agreed")
        except Exception as exc:  # nothing committed: every participant keeps its old state
            self.ctl.veto(f"ev/{e}/commit")
            cut_collective_sockets(self.ctl.port)  # peers still in a transfer with us fail now
            whole = old_rank is not None and set(held["local"]) == set(old_ms[old_rank].by_fqn())
            self._kept = held if whole else None  # release-early may have dropped verified pieces already
            msg = f"device {self.device}: migration failed ({type(exc).__name__}: {str(exc)[:200]}); old layout kept"
            if old_rank is not None and not whole:
                msg += " by the other replicas (this device released part of its old state early)"
            self.log(msg)
            self.ctl.set_result(e, self.device, {"ok": False, "error": msg, "phases": {}})
            return self.device not in ev.get("exit_fail", [])
        # what this process received from others (the launcher adds the participants' figures up)
        mine = new_ms[new_rank].by_fqn() if new_rank is not None else {}
        moved = sum(transfer_bytes(t, mine[t.fqn]) for t in transfers if t.dst == new_rank and same.get(t.dst) != t.src)
        groups = self.ctl.formed_s(f"m{e}")
        # execute: the transfer; the digests' comparison (every message verified at both ends) is `other`
        phases = {"build_groups": groups, "execute": result.phases.get("transfer", t2 - t1),
                  "other": other + result.phases.get("verify", 0.0)}
        verified = {"units_verified": result.units_verified, "verified": True}
        if new_rank is None:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.ctl.pg_members = None
            self.ctl.set_result(e, self.device, {"ok": True, "step": None, "bytes_moved": moved, "phases": phases,
                                                 **verified})
            return self.device not in ev.get("exit_ok", [])  # on a node that stays: standby
        t3 = time.perf_counter()
        src = same.get(new_rank, alive[0])
        extras = _loads(self.ctl.store.get(f"ev/{e}/extra/{src}"))
        self.step = int(self.ctl.store.get(f"ev/{e}/step/{src}").decode())
        for k, obj in self.extras.items():
            obj.load_state_dict(extras[k])
        phases["other"] += time.perf_counter() - t3
        report = {"ok": True, "step": self.step, "bytes_moved": moved, **verified}
        t4 = time.perf_counter()
        try:
            groups_w = self._enter(curr["layout"], curr["devices"], f"w{e}", result, keep=True)
        except C.WorldAborted:  # committed, but a new-layout peer died before training: the launcher recovers
            self.ctl.set_result(e, self.device, {**report, "phases": phases})
            raise
        self.ctl.mark("built")
        self.migrations += 1
        phases.update(build_groups=groups + groups_w, rebuild=time.perf_counter() - t4 - groups_w)
        self.ctl.set_result(e, self.device, {**report, "phases": phases})
        return True

    def _leave(self) -> None:
        import torch.distributed as dist

        self.safety.settle()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _on_meta(build, lay, tp_plan: Mapping):
    """`build(lay)` on the meta device, for a migration to fill with the state it received (_assemble),
    or None where that is not safe: a TP plan to apply (DTensor), another backend than gloo, a tensor
    the state dict does not carry (a plain tensor attribute, a non-persistent buffer: no load fills
    it), or a tensor under two names (tied weights: assigning each name its own tensor unties them)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() != "gloo":
        return None
    with torch.device("meta"):
        module = build(lay)
    if lay.tp > 1 and _stage_plan(module, tp_plan):
        return None
    keys = set(module.state_dict())
    for name, mod in module.named_modules():
        if any(isinstance(v, torch.Tensor) for v in vars(mod).values()) or \
                any(b is not None and (f"{name}." if name else "") + k not in keys for k, b in mod._buffers.items()):
            return None
    held = [t for _n, t in module.named_parameters(remove_duplicate=False)] + \
        [t for _n, t in module.named_buffers(remove_duplicate=False)]
    if len({id(t) for t in held}) != len(held):
        return None
    return module


def _assemble(module, build_opt, local: Mapping):
    """`module` (built on the meta device, _on_meta) and its optimizer holding the tensors of `local`
    themselves, no copy: the parameters and buffers are assigned (load_state_dict assign=True), the
    optimizer's state is loaded from the received `optim.state.<param>.<key>` tensors (torch keeps a
    tensor of the right dtype and device as it is). The received tensors were allocated and written
    before the pause (migrate.reshard.allocate_targets), so training goes on in memory already mapped."""
    module.load_state_dict({k: local[k] for k in module.state_dict()}, assign=True)
    opt = build_opt(module.parameters())
    names = _param_names(module)
    keys: dict[str, list[str]] = {}
    for fqn in local:
        if fqn.startswith("optim.state."):
            name, _, key = fqn.removeprefix("optim.state.").rpartition(".")
            keys.setdefault(name, []).append(key)
    sd = opt.state_dict()
    order = [p for g in opt.param_groups for p in g["params"]]
    sd["state"] = {i: {k: local[f"optim.state.{names[id(p)]}.{k}"] for k in keys[names[id(p)]]}
                   for i, p in enumerate(order) if names[id(p)] in keys}
    opt.load_state_dict(sd)
    return module, opt


def _stage_plan(module, tp_plan: Mapping) -> dict:
    """The entries of `tp_plan` that name a module this stage holds (a pipeline stage lacks the others;
    parallelize_module would warn about every one of them)."""
    from fnmatch import fnmatch

    names = [n for n, _ in module.named_modules()]
    return {k: v for k, v in tp_plan.items() if any(fnmatch(n, k) for n in names)}


def _forget_old_meshes() -> None:
    """Drop DTensor's sharding-propagation caches when a new world begins. They key on DeviceMesh
    equality, which ignores the process groups: a new mesh shaped like one of an earlier world (tp2dp2
    again after a grow) would get cached output specs that carry the old mesh, whose group names were
    destroyed with its world or now name other groups of the new one (seen as "Could not resolve the
    process group registered under the name N" on one rank, "Connection closed by peer" on the rest)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


# -- torch-native state in and out ----------------------------------------------------------------
def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _state_views(model, opt) -> dict:
    """This rank's pieces by FQN (migrate.manifest naming): the model's and optimizer's own local tensors."""
    out = {k: _local(v) for k, v in model.state_dict().items()}
    names = _param_names(model)
    for p, st in opt.state.items():
        for key, v in st.items():
            if hasattr(v, "shape"):
                out[f"optim.state.{names[id(p)]}.{key}"] = _local(v)
    return out


def _param_names(model) -> dict[int, str]:
    """id(parameter) -> its name: how optimizer state (keyed by parameter) gets its FQN."""
    return {id(p): n for n, p in model.named_parameters()}


def _export_local(model, opt) -> dict:
    """This rank's pieces by FQN, detached from the model: views of its tensors, no copy (the model and
    optimizer are dropped right after, so nothing changes them; --release-early frees them one by one)."""
    return {k: v.detach() for k, v in _state_views(model, opt).items()}


def _load_local(model, opt, local: Mapping) -> None:
    import torch

    with torch.no_grad():
        for k, v in model.state_dict().items():
            _local(v).copy_(local[k])
        names = _param_names(model)
        for p, st in opt.state.items():
            for key, v in st.items():
                if hasattr(v, "shape"):
                    _local(v).copy_(local[f"optim.state.{names[id(p)]}.{key}"])


def _optimizer_kind(build_opt) -> str:
    import torch

    name = type(build_opt([torch.nn.Parameter(torch.zeros(1))])).__name__.lower()
    from migrate.manifest import OPTIMIZER_STATE

    if name not in OPTIMIZER_STATE:
        raise RuntimeError(f"optimizer {name}: live mode knows the state of {', '.join(OPTIMIZER_STATE)}")
    return name


def _dumps(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _default_threads() -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


# -- joining --------------------------------------------------------------------------------------
def join(*, model: Callable, optimizer: Callable, tp_plan: Mapping | None = None,
         state: Mapping[str, object] | None = None, manifest: Callable | None = None,
         model_info: Mapping | None = None, collective_timeout: float = 120.0) -> Job:
    """Join the elastic job as one live-mode worker; returns the Job whose `next_step()` drives training.

    model(layout) -> nn.Module: the whole model, created identically on every rank (seed it); with
    layout.pp > 1 only the stage `layout.pp_rank` of it, under the whole model's names (see above);
    tp_plan: parallelize_module's plan, applied by the runtime when the layout has tp > 1;
    optimizer(params) -> torch.optim.Optimizer; state: extra objects with state_dict/load_state_dict;
    manifest(layout) -> migrate.manifest.Manifest: for a model that shards itself (its parameters are plain
    tensors holding its TP shard, Megatron-style, e.g. migrate.gpt_live), what the rank `layout.rank` of a
    layout holds (called for layouts no process holds yet too); without it the runtime derives it from
    `tp_plan` on the meta device. model_info: what the script says its model is (JSON-able, e.g. its model
    flags): every worker of the job must give the same, a worker whose model differs exits with status 2 and
    one line naming both. collective_timeout: seconds a collective (and forming a process group) may wait
    for a peer before failing.

    Every worker computes on OMP_NUM_THREADS threads, 1 unless the environment sets it (torchrun's
    default, which the workers started in restart mode get): workers started later by a grow then
    compute exactly like the first ones (a reduction's order can depend on the thread count)."""
    from launcher.worker import device_from_env

    if C.ENV_STORE not in os.environ:
        raise RuntimeError(f"{JOIN_CALL}: this program must be started by elastic-launch (${C.ENV_STORE} is unset)")
    _default_threads()
    device, local_id, gpn = device_from_env()
    try:
        nice_from_env()
        cma_enabled_from_env()
    except ValueError as exc:
        print(f"runtime: device {device}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    ctl = C.Control.from_env()
    ctl.hello(device)
    job = Job(ctl, device, model, tp_plan, optimizer, state or {}, manifest, collective_timeout, (local_id, gpn))
    # the launcher places ranks with the ETC planner over these, for every layout shape it may choose
    shapes = ctl.get_json(C.KEY_SHAPES) if ctl.has(C.KEY_SHAPES) else ["pp1tp1"]
    spec = {"kind": "generic", "tp_plan": sorted(job.tp_plan), "info": dict(model_info or {}),
            "manifests": {s: [m.to_list() for m in job._class_manifests(s)] for s in shapes}}
    spec = json.loads(json.dumps(spec, sort_keys=True))
    agreed = ctl.offer_model(spec)
    if agreed != spec:
        if spec["info"] != agreed.get("info"):
            print(f"runtime: device {device}: model {spec['info']} differs from the job's {agreed.get('info')}; "
                  "give every worker the same model flags", file=sys.stderr)
        else:
            print(f"runtime: this worker's model {spec['tp_plan']} differs from the job's {agreed.get('tp_plan')} "
                  "(or its state manifests do)", file=sys.stderr)
        raise SystemExit(2)
    from migrate.warmup import first_calls

    first_calls(optimizer)  # first-call costs before ready: a joiner pays them while the old layout trains
    ctl.set_ready(device, {"pid": os.getpid(), "host": socket.gethostname(), "api": "runtime"})
    return job
