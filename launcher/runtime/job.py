"""One worker's side of a live-mode job: join the control plane, train, and take part in every
migration at the step boundary the launcher posts (the public API is launcher.runtime)."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping

from launcher.runtime import ckpt as runtime_ckpt
from launcher.runtime import faults as runtime_faults
from launcher.runtime.build import Builder
from launcher.runtime.clip import average_over_dp, clip_grad_norm_ as clip_grads
from launcher.runtime.collector import CollectorHold
from launcher.runtime.events import EventBoundary
from launcher.runtime.env import checkpoints_from_env, device_from_env, first_event_from_env, runtime_log_from_env
from launcher.runtime.layout import Layout, device_mesh, parse_layout
from launcher.runtime.migration import Migration
from launcher.runtime.overhead import StepCost
from launcher.runtime.sockets import cut_collective_sockets
from launcher.runtime.state import OptimizerSettings, export_local, rebind, state_views, unbind
from launcher.runtime.suspend import suspend
from launcher.runtime.threads import GlooThreads, nice_from_env
from launcher.runtime.vote import StepVote
from launcher.runtime.worlds import Worlds, forget_old_meshes
from launcher.wire.control import Control, WorldAborted
from launcher.wire.env import ENV_STORE
from migrate.cma import enabled_from_env as cma_enabled_from_env


#: what the ranks of a training world can disagree on (Job._disagree), and the fix, in the vote's `agree` order
DISAGREE = (("the step", "every rank must call job.next_step() and optimizer.step() once per step"),
            ("the learning rate", "declare the scheduler to join(scheduler=...) instead of making it on "
                                  "job.optimizer (a worker that joins later would start its own from the beginning)"),
            ("the optimizer's settings", "change them alike on every rank, from a scheduler declared to "
                                         "join(scheduler=...) or an object given to join(state=...)"))

#: what the launcher names when a joined worker never reaches the step boundary
STEP_CALL = "job.next_step()"
JOIN_CALL = "launcher.runtime.join(...)"


class Job:
    """One worker of a live-mode job (see the module docstring); made by `join`."""

    def __init__(self, ctl: Control, device: int, model: Callable, tp_plan: Mapping | None,
                 optimizer: Callable, state: Mapping[str, object], manifest: Callable | None = None,
                 collective_timeout: float = 120.0, local: tuple[int, int] = (0, 1),
                 scheduler: Callable | None = None, fsdp_units: Callable | None = None) -> None:
        self.ctl, self.device = ctl, device
        self._log_to = runtime_log_from_env(device) or sys.stderr
        self.timeout = collective_timeout  # seconds a collective may wait for a peer
        self._local = local  # (local rank, workers per node): torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE
        self.builder = Builder(model, tp_plan, optimizer, manifest, fsdp_units)
        self.tp_plan = self.builder.tp_plan
        self.worlds = Worlds(ctl)
        self.extras = dict(state)
        self.model = None
        # the one optimizer object of this worker: rebound to every layout's parameters (state.rebind)
        self.optimizer = self.builder.placeholder_optimizer()
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.settings = OptimizerSettings(self.optimizer)
        self._carry(self.settings, self.scheduler)
        self.layout: Layout | None = None
        self.step = 0
        self.epoch = first_event_from_env()
        self.devices: list[int] = []
        self.vote = StepVote(ctl)  # every optimizer step's commit (launcher.runtime.vote)
        self.cost = StepCost()  # what the runtime costs a step ($ELASTIC_RUNTIME_STATS)
        self.migrations = 0
        self.world: str | None = None  # the training world (launcher.wire.control: w<event>)
        self.came_by: str | None = None  # the migration that made this world, e.g. "the grow A -> B" (_disagree)
        self.broken = False  # a step failed because a peer did: wait for the launcher's recovery event
        self._committed = 0  # the last step whose optimizer update committed (launcher.runtime.faults)
        self._entered_at = 0  # the step this worker entered its current world at (_enter)
        self._collector = CollectorHold()  # the garbage collector kept out of a migration's pause
        self._gloo = GlooThreads()  # gloo's I/O threads at a low priority (launcher.runtime.threads)
        self._snap: dict = {}  # the registered objects' state at the last step boundary
        self._kept: dict | None = None  # state held while no model is built (a migration that did not commit)
        self.ckpt_dir, self.ckpt_every = checkpoints_from_env()
        self._saved = -1  # the last step a safety checkpoint was written at
        self.migration = Migration(self)  # this worker's part in reshard events
        self.events = EventBoundary(ctl, self.vote, self.migration.prepare, self.log)  # when the next one applies
        self.fault = runtime_faults.fault_for(device)  # $ELASTIC_FAULT (tests)
        self.safety = runtime_ckpt.Safety(self.ckpt_dir, self.log, self.fault)  # background safety checkpoints
        runtime_faults.install_commit(self.optimizer, self._vote)

    def _carry(self, settings: OptimizerSettings, scheduler) -> None:
        """The objects a migration hands over, a step that failed takes back and a checkpoint holds: the script's,
        the optimizer's settings and the scheduler (launcher.runtime.ckpt keeps the runtime's two apart)."""
        own = {"runtime.optimizer": settings, "runtime.scheduler": scheduler}
        taken = sorted(set(own) & set(self.extras))
        if taken:
            raise ValueError(f"{JOIN_CALL}: the state names {taken} are the runtime's")
        self.carried = {**self.extras, **{k: v for k, v in own.items() if v is not None}}

    def log(self, msg: str) -> None:
        print(f"[runtime dev{self.device} ev{self.epoch}] {msg}", file=self._log_to, flush=True)

    # -- the step boundary ------------------------------------------------------------------------
    def next_step(self, until: int | None = None) -> bool:
        """Call before every step: publishes progress, applies a migration or stop that is due here.
        True: run step `job.step` now (it counts from 1: `job.step` already is the step being run inside the
        loop, and `until=N` runs steps 1..N); False: the job is over for this worker (exit)."""
        t0, epoch = time.perf_counter(), self.epoch
        going = self._next_step(until)
        self.cost.boundary(t0, time.perf_counter(), epoch == self.epoch)  # launcher.runtime.overhead
        return going

    def _next_step(self, until: int | None) -> bool:
        while True:
            live = self.model is not None and not self.broken
            if live:
                self._boundary()
                live = not self.broken
            ev = self.events.due(self.epoch, self.step, self._committed == self.step > self._entered_at,
                                 self.layout.rank, self.device) if live else self.ctl.wait_event(self.epoch)
            if ev is not None and (not live or self.step >= self.events.at):
                self.events.clear()
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
        """Wrap each step's body in it: when another worker dies during the step, the step is abandoned here
        (the state of the last committed step is kept, see launcher.runtime.faults) and the next `next_step()`
        waits for the launcher to recover the job. Any other error is raised."""
        try:
            yield
        except Exception as exc:
            if self.model is None or not runtime_faults.is_peer_failure(exc, self.ctl, self.world, self._cut):
                raise
            self._abandon(exc)

    def report_loss(self, loss) -> None:
        """This step's loss for the job's timeline (`elastic history`, the dashboard): the launcher records
        every report. Call it on one rank, after the step (e.g. layout.rank == 0)."""
        self.ctl.report_loss(self.step, float(loss), self.layout.name)

    def reduce_gradients(self) -> None:
        """Average the gradients over the DP replicas (call after backward, before optimizer.step)."""
        average_over_dp(self.model.parameters(), self.layout)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0):
        """torch's clip_grad_norm_ for the layout's whole model (TP shards, PP stages): launcher.runtime.clip."""
        return clip_grads(self.model.named_parameters(), self.layout, max_norm, norm_type, self._my_manifest())

    # -- consistent cuts and safety checkpoints -----------------------------------------------------
    def _boundary(self) -> None:
        """Between two steps: the heartbeat, the registered objects' state (to take back if the next step
        fails), and a safety checkpoint when one is due (written in the background: runtime_ckpt.Safety).
        gloo's I/O threads of process groups made since the last boundary are lowered (runtime_threads)."""
        self._gloo.lower()
        self.vote.heartbeat(self.device, self.step, self.layout.rank)
        if self.step > self._entered_at:  # a step committed in this world: the pause is over
            self._collector.release()
            if self.worlds.retired:  # tear the old world down
                self.worlds.drop_retired()
        self._snap = self._extras_state()
        self.safety.poll()
        if self.ckpt_every and self.step and self.step % self.ckpt_every == 0 and self._saved != self.step:
            self._saved = self.step
            with self.guard():
                self.safety.start(self.step, self.layout.rank, state_views(self.model, self.optimizer),
                                  self._my_manifest(), self.layout.stage_mesh, self.carried)

    def _vote(self) -> None:
        """The optimizer's pre-step hook: apply this step only if every rank of the world does."""
        if self._committed == self.step:
            return  # a second optimizer.step() in the same step
        runtime_faults.die_at(self.fault, "step", self.step, self.log)
        self.ctl.mark("voted")
        t0 = time.perf_counter()
        verdict = self.vote.vote(self.world, self.step - 1, self.layout.rank, self.layout.world_size, self.epoch,
                                 agree=(self.step, *self.settings.fingerprints()))
        self.cost.voted(time.perf_counter() - t0)
        if verdict.disagree:
            self._disagree(verdict.disagree)
        if not verdict.committed:
            why = f" ({type(verdict.failure).__name__}: {str(verdict.failure)[:200]})" if verdict.failure else ""
            raise runtime_faults.StepAborted(f"step {self.step} abandoned: a worker of {self.world} failed{why}")
        self.ctl.mark("committed")
        self.ctl.stamp_first_step(self.world)
        self._committed, self.events.told = self.step, verdict.event
        if verdict.failure is not None:  # committed everywhere, yet a peer is gone: apply it, then recover
            self._abandon(verdict.failure)

    def _disagree(self, apart: tuple[int, ...]) -> None:
        """The ranks hold different steps or optimizer settings (the vote's `agree` values, in this order):
        training on would diverge in silence (the replicas step with different learning rates), and no
        recovery can tell which rank is right. Every rank says so to the launcher, which stops the job with
        this one line; rank 0 prints it; every rank exits with status 2, as a worker whose model differs."""
        what = " and ".join(DISAGREE[i][0] for i in apart)
        fix = next(DISAGREE[i][1] for i in (1, 2, 0) if i in apart)
        where = f"at step {self.step}" + (f", after {self.came_by}" if self.came_by else "")
        why = f"workers disagree on {what} {where}: {fix}"
        self.ctl.give_up(why)
        if self.layout.rank == 0:
            print(f"runtime: {why}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def _cut(self) -> None:
        cut_collective_sockets(self.ctl.port)  # peers blocked on this worker fail at once

    def _abandon(self, exc: BaseException) -> None:
        """A peer failed this step: fail every peer still waiting on us, keep the last committed state."""
        self.log(f"step {self.step} failed ({type(exc).__name__}: {str(exc)[:200]}); state kept at step "
                 f"{self._committed}, waiting for recovery")
        self.broken = True
        if self.step != self._committed:  # the update was not applied: back to the boundary before it
            self.step = self._committed
            for k, obj in self.carried.items():
                obj.load_state_dict(self._snap[k])
        try:
            self.ctl.abort_world(self.world)
            self.ctl.suspect(self.world, self.device, f"{type(exc).__name__}: {exc}")  # alive: see launcher.loop.probe
            self.vote.heartbeat(self.device, self.step, None, force=True)  # the step the survivors hold
        except Exception:
            pass
        self._cut()

    def _my_manifest(self):
        return self.builder.manifests(self.layout.name)[self.layout.rank]

    def _extras_state(self) -> dict:
        return {k: copy.deepcopy(v.state_dict()) for k, v in self.carried.items()}

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
                return self.migration.run(ev)
            if kind == "resume":  # a migration did not commit: train on the old layout again
                return self._resume(ev)
            if kind == "suspend":
                return suspend(self, ev)
            if kind == "exit":
                return self.device not in ev["devices"]
        except WorldAborted as exc:  # a member died before the world formed: the launcher recovers
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
                    path, state_views(self.model, self.optimizer), self._my_manifest(), self.layout.stage_mesh,
                    self.carried)
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
        for k, obj in self.carried.items():
            obj.load_state_dict(held["extras"][k])
        self._enter(ev["layout"], ev["devices"], f"w{ev['epoch']}", held["local"])
        self.log(f"resumed as rank {self.layout.rank} of {self.layout.name} at step {self.step}")
        return True

    def _enter(self, layout: str, devices: list[int], world: str, local: dict | None, keep: bool = False) -> float:
        """Join the layout's world, build model and optimizer there, fill them with `local` if given;
        returns the seconds spent forming process groups (the rest is the rebuild). keep=True (the
        process group this worker is in is healthy: a migration just committed in it) keeps that group
        when its members are exactly `devices` in rank order (launcher.runtime.worlds), so process-group
        ranks stay the layout's ranks. WorldAborted when a member died first: `local` is kept for the
        recovery."""
        t0 = time.perf_counter()
        keep = keep and self.worlds.pg_members == list(devices)
        try:
            rank = self.worlds.join(world, devices, self.device, self.timeout, abort_key=self.ctl.abort_key(world),
                                    keep=keep)
        except WorldAborted:
            self._drop_built()
            self._kept = None if local is None else {"local": local, "step": self.step,
                                                     "extras": self._extras_state()}
            raise
        forget_old_meshes()
        lay = parse_layout(layout, rank, len(devices))
        lay.mesh = device_mesh(lay)
        groups_s = time.perf_counter() - t0
        # torchrun's variables for the code of this world (MASTER_* name the control-plane store)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(len(devices)), "LOCAL_RANK": str(self._local[0]),
                           "LOCAL_WORLD_SIZE": str(self._local[1]), "MASTER_ADDR": self.ctl.host,
                           "MASTER_PORT": str(self.ctl.port), "ELASTIC_VIRTUAL_RANK": str(rank),
                           "ELASTIC_LAYOUT": lay.name})
        self.model, fresh = self.builder.build(lay, local)
        rebind(self.optimizer, fresh)
        self.layout, self.devices, self.world = lay, list(devices), world
        self.broken, self._kept, self._committed, self._saved = False, None, self.step, self.step
        self._entered_at = self.step
        return groups_s

    def _release(self) -> dict | None:
        """Drop model and optimizer; returns the state they (or a kept copy) held: local tensors, step, objects."""
        if self.model is not None:
            held = {"local": export_local(self.model, self.optimizer), "step": self.step,
                    "extras": self._extras_state()}
        else:
            held = self._kept
        self._drop_built()
        self._kept = None
        return held

    def _drop_built(self) -> None:
        """No model on this worker now; its optimizer object stays, holding its settings only."""
        self.model = None
        unbind(self.optimizer)

    def _leave(self) -> None:
        import torch.distributed as dist

        self.safety.settle()
        self.cost.write(self.device)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _default_threads() -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


# -- joining --------------------------------------------------------------------------------------
def join(*, model: Callable, optimizer: Callable, tp_plan: Mapping | None = None,
         state: Mapping[str, object] | None = None, scheduler: Callable | None = None,
         manifest: Callable | None = None, model_info: Mapping | None = None,
         collective_timeout: float = 120.0, fsdp_units: Callable | None = None) -> Job:
    """Join the elastic job as one live-mode worker; returns the Job whose `next_step()` drives training.

    model(layout) -> nn.Module: the whole model, created identically on every rank (seed it); with
    layout.pp > 1 only the stage `layout.pp_rank` of it, under the whole model's names (see above);
    tp_plan: parallelize_module's plan, applied by the runtime when the layout has tp > 1; on a layout with
    fsdp > 1 (`tp2fsdp4`, `tp2hsdp2x2`) the runtime then applies FSDP2's fully_shard over the layout's fsdp
    mesh, torchtitan's order, and the script splits its batch by layout.data_rank of layout.data_size;
    fsdp_units(module) -> the submodules FSDP2 shards as units of their own first (torchtitan: each transformer
    block), so a forward gathers one block's parameters at a time instead of the whole stage's at once;
    optimizer(params) -> torch.optim.Optimizer: `job.optimizer` is one object from `join` on (its parameters
    and state are each layout's, its settings -- lr, betas, weight_decay, any key -- carry over), so what
    is made on it keeps working; state: extra objects with state_dict/load_state_dict;
    scheduler(optimizer) -> an LR scheduler (any torch.optim.lr_scheduler, chained or sequential too):
    made on `job.optimizer` as `job.scheduler`, its state moved with the optimizer's settings by every
    migration (a scheduler made outside it would not be: a worker that joins later would start it from
    the beginning); checkpoints hold both, so a restore goes on with the schedule;
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
    if ENV_STORE not in os.environ:
        raise RuntimeError(f"{JOIN_CALL}: this program must be started by elastic-launch (${ENV_STORE} is unset)")
    _default_threads()
    device, local_id, gpn = device_from_env()
    try:
        nice_from_env()
        cma_enabled_from_env()
    except ValueError as exc:
        print(f"runtime: device {device}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    ctl = Control.from_env()
    ctl.hello(device)
    job = Job(ctl, device, model, tp_plan, optimizer, state or {}, manifest, collective_timeout, (local_id, gpn),
              scheduler, fsdp_units)
    # the launcher places ranks with the ETC planner over these, for every layout shape it may choose
    shapes = ctl.shapes() or ["pp1tp1"]
    spec = {"kind": "generic", "tp_plan": sorted(job.tp_plan), "info": dict(model_info or {}),
            "manifests": {s: [m.to_list() for m in job.builder.class_manifests(s)] for s in shapes}}
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
