"""`python -m launcher.worker`: one training worker (one device) of an elastic job.

elastic-launch starts one of these per device (through `srun` on Slurm, as local processes
with the local backend) and drives it through the control plane (see launcher.control):

  * it registers, offers its model spec, and waits for event 0, which says the layout and
    which devices train; a device outside the layout waits on standby;
  * a training worker runs the reference trainer (migrate.train) step after step, publishes its
    step count and, after each step, checks cheaply for the next event;
  * a migrate event is applied at the step boundary all workers agreed on: the old and new
    devices form one process-group world, run migrate.executor.execute on the posted plan (the
    executor verifies checksums: the state is bit-exact or the old layout is kept), then the
    new layout's devices form a new world and rebuild their trainer; departing workers exit 0;
  * a stop event ends the worker at the agreed boundary; a suspend event writes the job's state once
    (migrate.checkpoint.save_checkpoint, every training rank its own part) at the agreed boundary
    into $ELASTIC_CHECKPOINT_DIR/step-<S>, then ends it; a start event with a `checkpoint` loads
    that state on whatever layout it names (exact next step, same RNG and data position);
  * with $ELASTIC_CHECKPOINT_EVERY=N every N-th step is also saved in the background (a dedicated
    gloo group; training waits only for the in-memory copy) into .tmp-step-<S>, renamed to
    step-<S> by rank 0 once every rank's write finished, older ones removed: the directory always
    holds one complete safety checkpoint for a failure that no replica can recover from.

Failures (see launcher.control, "Consistent cuts"): every optimizer step and every migration
commits all-or-nothing through the control store. A step that fails (a peer died: gloo reports
the closed socket) marks the training world aborted and shuts this worker's collective sockets,
so peers blocked on it fail at once instead of waiting out --collective-timeout; the worker then
keeps its state (that of the last committed step) and waits for the launcher's next event: a
recovery migration (`urgent`) or `resume` on the old layout after a migration that did not commit.

Fault injection for tests: $ELASTIC_FAULT = "DEVICE:POINT[:N]", POINT one of `step` (SIGKILL
itself in step N, after its gradients, before the commit vote), `round` (in round N of a
migration's transfer), `commit` (after a migration's transfer, before its commit vote), `committed` (right after the
migration committed, before reporting).

torchrun's variables are set for the code of every epoch: RANK, WORLD_SIZE (the epoch's
training world), LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (the control-plane
store), plus ELASTIC_VIRTUAL_RANK and ELASTIC_LAYOUT.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback

from launcher import control as C
from launcher.runtime_faults import StepAborted, die_at, fault_for
from launcher.sockets import cut_collective_sockets


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launcher.worker",
        description="Elastic training worker running the reference GPT trainer (migrate.train). Started by "
                    "elastic-launch, one per device; it reads the control-plane address and its device from "
                    f"${C.ENV_STORE} and ${C.ENV_DEVICE} (or ${C.ENV_FIRST_DEVICE} + SLURM_LOCALID on Slurm).",
        epilog="Example: elastic-launch --nnodes 2:4 --gpus-per-node 4 --layouts pp4tp2,pp2tp2 --db sqlite:///e.db "
               "-- python -m launcher.worker --layers 24 --hidden 512",
    )
    m = p.add_argument_group("model (every worker of a job must give the same)")
    m.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    m.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    m.add_argument("--heads", type=int, default=0, help="attention heads (default hidden/64)")
    m.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    m.add_argument("--seq-len", type=int, default=32, help="sequence length (default 32)")
    t = p.add_argument_group("training")
    t.add_argument("--global-batch", type=int, default=8, help="sequences per step, fixed across layouts (default 8)")
    t.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    t.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    t.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data (default 0)")
    t.add_argument("--steps", type=int, default=0, help="stop after this many steps (default 0: until the launcher stops the job)")
    t.add_argument("--step-sleep", type=float, default=0.0, help="sleep this long after each step (demos and tests)")
    t.add_argument("--collective-timeout", type=float, default=120.0,
                   help="seconds a collective may wait for a peer before failing (default 120)")
    t.add_argument("--loss-file", default=None, metavar="PATH",
                   help="append `step loss layout` for every committed step to PATH (the rank that reports the "
                        "loss writes it; for tests and loss-curve comparisons)")
    t.add_argument("--log-every", type=int, default=1, help="print the loss every N steps (default 1; 0: never)")
    return p


def device_from_env(env=os.environ) -> tuple[int, int, int]:
    """(device id, local rank, gpus per node) of this worker."""
    gpn = int(env.get(C.ENV_GPUS_PER_NODE, "1"))
    local = int(env.get(C.ENV_LOCAL_ID, env.get("SLURM_LOCALID", "0")))
    if C.ENV_DEVICE in env:
        return int(env[C.ENV_DEVICE]), local, gpn
    if C.ENV_FIRST_DEVICE in env:  # one srun step per node: the node's first device id plus the task's index
        return int(env[C.ENV_FIRST_DEVICE]) + local, local, gpn
    if C.ENV_NODE_INDEX not in env:
        raise RuntimeError(f"neither ${C.ENV_DEVICE} nor ${C.ENV_NODE_INDEX} is set: start workers with elastic-launch")
    return int(env[C.ENV_NODE_INDEX]) * gpn + local, local, gpn


class Worker:
    def __init__(self, args: argparse.Namespace, ctl: C.Control, device: int, local: int, gpn: int) -> None:
        from migrate.layout import ModelSpec
        from migrate.train import TrainConfig

        self.args, self.ctl, self.device, self.local, self.gpn = args, ctl, device, local, gpn
        self.model = ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                               seq_len=args.seq_len)
        self.tc = TrainConfig(global_batch=args.global_batch, micro_batch=args.micro_batch, seq_len=args.seq_len,
                              lr=args.lr, seed=args.seed)
        self.trainer = None
        self.broken = False  # a collective failed: wait for a recovery event
        self.epoch = int(os.environ.get(C.ENV_FIRST_EVENT, "0"))
        self.layout_devices: list[int] = []
        self.world: str | None = None  # the training world this worker is in
        self.kept = None  # LocalState kept after a migration that did not commit (no trainer then)
        self.fault = fault_for(device)
        self.ckpt_dir = os.environ.get(C.ENV_CKPT_DIR) or None
        self.ckpt_every = int(os.environ.get(C.ENV_CKPT_EVERY, "0") or 0) if self.ckpt_dir else 0
        self.ckpt_group = None  # gloo group of the training world for background saves
        self.pending = None  # (future, step, coordinator?) of a safety checkpoint being written
        self.used_dcp = False
        self.prepared: dict[int, dict] = {}  # event -> new tensors allocated ahead of that migration
        self.world_rank: list[int] = []  # process-group rank of each virtual rank of the layout

    def _die(self, point: str, n: int | None = None) -> None:
        die_at(self.fault, point, n, self.log)

    def _abandon(self) -> None:
        """Make every peer waiting on this worker fail now: abort the world's step, shut the sockets."""
        if self.world is not None:
            try:
                self.ctl.abort_world(self.world)
            except Exception:
                pass
        cut_collective_sockets(self.ctl.port)

    def log(self, msg: str) -> None:
        print(f"[worker dev{self.device} ev{self.epoch}] {msg}", flush=True)

    # -- epochs -----------------------------------------------------------------------------
    def _export_env(self, world_rank: int, world_size: int, vrank: int | None, layout: str) -> None:
        os.environ.update({"RANK": str(world_rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(self.local),
                           "LOCAL_WORLD_SIZE": str(self.gpn), "MASTER_ADDR": self.ctl.host,
                           "MASTER_PORT": str(self.ctl.port), "ELASTIC_VIRTUAL_RANK": str(vrank),
                           "ELASTIC_LAYOUT": layout})

    def _train_on(self, layout: str, devices: list[int], state, world: str, keep: bool = False) -> float:
        """Join training world `world` of `devices` (virtual rank order), build the trainer;
        returns the seconds spent on process groups (the rest is the rebuild). keep=True: the process
        group this worker is in is healthy and may be kept when it has the same members (join_world)."""
        from migrate.layout import ParallelConfig
        from migrate.train import Groups, Trainer

        t0 = time.perf_counter()
        cfg = ParallelConfig.parse(layout)
        self.ckpt_group = None
        try:
            rank = self.ctl.join_world(world, devices, self.device, self.args.collective_timeout,
                                       abort_key=f"abort/{world}", keep=keep)
        except C.WorldAborted:
            self.trainer, self.kept, self.world = None, None if callable(state) else state, None
            self.log(f"{world} not formed (a member failed); state kept at step {state.step}, waiting for recovery")
            raise
        self._export_env(rank, len(devices), rank, str(cfg))
        self.world_rank = world_rank = self.ctl.world_ranks(devices)  # process-group rank of each virtual rank
        groups = Groups(cfg, world_rank, rank)
        if self.ckpt_every:  # background saves talk on their own group, never interleaved with training's
            import torch.distributed as dist

            self.ckpt_group = dist.new_group(world_rank, backend="gloo")
        if callable(state):  # load it now that the world exists (a checkpoint: collective reads)
            state = state(rank)
            self.used_dcp = True
        t1 = time.perf_counter()
        self.trainer = trainer = Trainer(self.model, cfg, rank, state, world_rank, groups, self.tc)
        self.layout_devices = devices
        self.broken = False
        self.world = world
        self.kept = None
        real_step = trainer.opt.step

        def committed_step(*a, **kw):  # all ranks apply step N, or none does
            self._die("step", trainer.step_no + 1)
            if not self.ctl.commit_step(world, trainer.step_no, len(devices)):
                raise StepAborted(f"step {trainer.step_no + 1} abandoned: a worker of {world} failed")
            if rank == 0 and trainer.step_no > 0:  # everybody is past the previous vote: drop its keys
                for key in (f"c/{world}/{trainer.step_no - 1}", f"c/{world}/{trainer.step_no - 1}/n"):
                    self.ctl.store.delete_key(key)
            return real_step(*a, **kw)

        trainer.opt.step = committed_step
        return t1 - t0

    def handle(self, ev: dict) -> bool:
        """Apply event `ev`; False when this worker is done."""
        kind = ev["kind"]
        self.epoch = ev["epoch"] + 1
        self._settle_checkpoint(timeout=120)  # the world may change: the background write finishes first
        if kind == "stop":
            self.log("stop")
            return False
        if kind == "suspend":
            return self._suspend(ev)
        if kind == "start":
            from migrate.layout import ParallelConfig
            from migrate.state import initial_state

            devices = ev["devices"]
            if self.device in devices:
                cfg = ParallelConfig.parse(ev["layout"])
                rank = devices.index(self.device)
                path = ev.get("checkpoint")
                if not path:
                    self._train_on(ev["layout"], devices, initial_state(self.model, cfg, rank, self.tc.seed),
                                   f"w{ev['epoch']}")
                    self.log(f"training as rank {rank} of {cfg}")
                    return True
                from migrate.checkpoint import load_checkpoint

                t0 = time.perf_counter()
                try:
                    self._train_on(ev["layout"], devices,
                                   lambda r: load_checkpoint(self.model, cfg, r, path, list(range(len(devices)))),
                                   f"w{ev['epoch']}")
                except Exception as exc:
                    self.ctl.set_result(ev["epoch"], self.device, {"ok": False, "error": f"device {self.device}: "
                                        f"loading {path} failed: {type(exc).__name__}: {exc}", "phases": {}})
                    raise
                self.ctl.set_result(ev["epoch"], self.device, {"ok": True, "step": self.trainer.step_no,
                                                               "phases": {"rebuild": time.perf_counter() - t0}})
                self.log(f"training as rank {rank} of {cfg} from {path} at step {self.trainer.step_no}")
            return True
        if kind == "migrate":
            return self._migrate(ev)
        if kind == "resume":  # a migration did not commit: train on the old layout again
            devices = ev["devices"]
            if self.device in devices:
                state = self.kept if self.kept is not None else self.trainer.export_state()
                self._train_on(ev["layout"], devices, state, f"w{ev['epoch']}")
                self.log(f"resumed as rank {devices.index(self.device)} of {ev['layout']} at step {state.step}")
            return True
        if kind == "exit":
            return self.device not in ev["devices"]
        raise RuntimeError(f"unknown event kind {kind!r}")

    # -- checkpoints ------------------------------------------------------------------------
    def _suspend(self, ev: dict) -> bool:
        """Write the state once at the agreed boundary (every training rank its part), then end."""
        import torch.distributed as dist

        if self.trainer is None or self.device not in self.layout_devices or self.broken:
            return False
        from migrate.checkpoint import save_checkpoint

        step, rank = self.trainer.step_no, self.trainer.rank
        tmp, _final = C.checkpoint_paths(self.ckpt_dir, step)
        result: dict = {"ok": False, "step": step, "phases": {}}
        t0 = time.perf_counter()
        try:
            self.used_dcp = True
            save_checkpoint(self.model, self.trainer.cfg, self.trainer.export_state(), tmp,
                            self.world_rank)
            dist.barrier()  # every rank's part is on disk (and DCP needs it before teardown)
            if rank == 0:
                C.finalize_checkpoint(self.ckpt_dir, step)
            result.update(ok=True, path=str(_final), phases={"other": time.perf_counter() - t0})
            self.log(f"suspended: state of step {step} written to {_final}")
        except Exception as exc:
            result["error"] = f"device {self.device}: checkpoint of step {step} failed: {type(exc).__name__}: {exc}"
            self.log(result["error"])
        self.ctl.set_result(ev["epoch"], self.device, result)  # the launcher reads the folder once all reported
        return False

    def _safety_checkpoint(self, step: int) -> None:
        """Start a background save of this step (training goes on once the copy is staged)."""
        from migrate.checkpoint import save_checkpoint

        self._settle_checkpoint(timeout=300)
        tmp, _final = C.checkpoint_paths(self.ckpt_dir, step)
        self.used_dcp = True
        try:
            fut = save_checkpoint(self.model, self.trainer.cfg, self.trainer.export_state(), tmp,
                                  self.world_rank, group=self.ckpt_group, background=True)
        except Exception as exc:
            self.log(f"safety checkpoint of step {step} not started: {type(exc).__name__}: {exc}")
            return
        self.pending = (fut, step, self.trainer.rank == 0)

    def _settle_checkpoint(self, timeout: float | None = None, only_if_done: bool = False) -> None:
        """Finish the background save in flight (rank 0 publishes it); a failed one is dropped."""
        if self.pending is None:
            return
        fut, step, coordinator = self.pending
        if only_if_done and not fut.done():
            return
        self.pending = None
        try:
            fut.result(timeout=timeout)
        except Exception as exc:
            self.log(f"safety checkpoint of step {step} dropped: {type(exc).__name__}: {str(exc)[:200]}")
            return
        if coordinator:
            try:
                path = C.finalize_checkpoint(self.ckpt_dir, step)
                self.log(f"safety checkpoint {path}")
            except OSError as exc:
                self.log(f"safety checkpoint of step {step} not published: {exc}")

    def _prepare(self, ev: dict) -> None:
        """Allocate the new state this worker will receive (migrate.executor.prepare_targets) for
        migrate event `ev`, unless it releases old tensors early (then memory, not time, comes first)."""
        if ev["kind"] != "migrate" or self.device not in ev["participants"] or ev.get("release_early") \
                or ev["epoch"] in self.prepared:
            return
        from migrate.executor import prepare_targets
        from migrate.plan import MigrationPlan

        self.prepared[ev["epoch"]] = prepare_targets(MigrationPlan.from_dict(ev["plan"]), self.device)

    def _migrate(self, ev: dict) -> bool:
        import torch.distributed as dist

        from migrate.executor import MigrationError, execute
        from migrate.plan import MigrationPlan

        e, participants = ev["epoch"], ev["participants"]
        if self.device not in participants:
            return self.device not in ev["exit_ok"]
        self.ctl.mark("boundary")
        healthy = self.trainer is not None and not self.broken  # its training world's steps commit: keep it
        p = MigrationPlan.from_dict(ev["plan"])
        state = self.trainer.export_state() if self.trainer is not None else self.kept
        if self.device in p.failed:
            state = None
        if self.trainer is not None:
            self.trainer.opt.__dict__.pop("step", None)  # the commit hook's cycle would keep old tensors alive
        self.trainer = None
        self._prepare(ev)  # a joining worker allocates while it waits for the old layout's last step
        targets = self.prepared.pop(e, None)
        result = {"ok": False, "phases": {}, "error": None, "units_verified": 0}
        try:
            try:
                self.ctl.join_world(f"m{e}", participants, self.device, self.args.collective_timeout,
                                    abort_key=f"ev/{e}/commit", keep=healthy)
            except C.WorldAborted as exc:
                raise MigrationError(f"device {self.device}: {exc}; old layout kept") from None
            t1 = time.perf_counter()
            hook = (lambda r: self._die("round", r)) if self.fault and self.fault[0] == "round" else None
            res = execute(p, self.device, state, world_rank=dict(zip(participants, self.ctl.world_ranks(participants))),
                          on_round=hook,
                          release_early=bool(ev.get("release_early")), targets=targets)
            self.ctl.mark("moved")
            self._die("commit")
            if not self.ctl.decide(f"ev/{e}/commit", len(participants)):
                raise MigrationError(f"device {self.device}: another participant failed or the launcher vetoed "
                                     "the commit; old layout kept")
            self._die("committed")
            self.ctl.mark("agreed")
            t2 = time.perf_counter()
            new_devices = list(p.curr.devices)
            result["units_verified"] = res.units_verified
            new_state = res.state
            leave = self.device in ev["exit_ok"] or self.device not in new_devices
            groups_s = 0.0
            if not leave:
                try:
                    groups_s = self._train_on(str(p.curr.layout), new_devices, new_state, f"w{e}", keep=True)
                except C.WorldAborted:  # committed, but a new-layout peer died before training
                    result.update(ok=True, step=new_state.step, phases={"execute": t2 - t1})
                    self.ctl.set_result(e, self.device, result)
                    return True
            elif dist.is_initialized():
                dist.destroy_process_group()
            t3 = time.perf_counter()
            self.ctl.mark("built")
            result.update(ok=True, step=new_state.step if new_state else None, phases={
                "build_groups": self.ctl.formed_s(f"m{e}") + groups_s, "execute": res.phases.get("execute", t2 - t1),
                "other": res.phases.get("other", 0.0), "rebuild": (t3 - t2) - groups_s})
            self.ctl.set_result(e, self.device, result)
            self.log(f"migrated to {p.curr.layout}" + ("; leaving" if leave else f" as rank {new_devices.index(self.device)}"))
            return self.device not in ev["exit_ok"]
        except MigrationError as exc:
            result["error"] = str(exc)
            self.log(f"migration failed: {exc}")
            self.ctl.veto(f"ev/{e}/commit")
            cut_collective_sockets(self.ctl.port)  # peers still in a transfer with us fail now
            self.ctl.set_result(e, self.device, result)
            if self.device in ev.get("exit_fail", []):
                return False
            # keep the old state; the launcher says what next (`resume`, or a recovery migration)
            self.kept = state if self.device in p.prev.devices else None
            self.world = None
            return True

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        import torch

        torch.set_num_threads(1)
        import migrate.executor  # noqa: F401  (import now, not inside the timed phases)
        import migrate.plan  # noqa: F401
        import migrate.train

        migrate.train.warm_up()  # a standby worker must not pay first-use costs inside a migration
        spec = {k: getattr(self.model, k) for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq_len", "dtype",
                                                      "optimizer")}
        agreed = self.ctl.offer_model(spec)
        if agreed != json.loads(json.dumps(spec, sort_keys=True)):
            print(f"worker dev{self.device}: model {spec} differs from the job's {agreed}; give every worker the "
                  "same model flags", file=sys.stderr)
            return 2
        self.ctl.set_ready(self.device, {"pid": os.getpid(), "host": socket.gethostname()})
        while True:
            try:
                if not self._tick():
                    self._settle_checkpoint(timeout=120)
                    return 0
            except (_Broken, C.WorldAborted):
                continue

    def _tick(self) -> bool:
        """One step or one event; False when the worker is done."""
        if self.trainer is None or self.broken:
            return self.handle(self.ctl.wait_event(self.epoch))
        ev = self.ctl.event(self.epoch)
        if ev is not None:
            self.ctl.mark("event seen")
            if not ev.get("urgent"):
                at = self.ctl.agree_at(self.epoch, self.trainer.step_no)
                self._prepare(ev)  # while the old layout still trains, outside the pause
                while self.trainer.step_no < at:
                    self._step()
            return self.handle(ev)
        if self.args.steps and self.trainer.step_no >= self.args.steps:
            self.log(f"reached --steps {self.args.steps}")
            return False
        self._step()
        return True

    def _step(self) -> None:
        try:
            loss = self.trainer.train_step()
        except Exception as exc:  # a peer died mid-step: keep the state, wait for the launcher
            self.log(f"step {self.trainer.step_no + 1} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                     f"state kept at step {self.trainer.step_no}, waiting for recovery")
            self.broken = True
            self._abandon()
            raise _Broken() from exc
        step = self.trainer.step_no
        self.ctl.set_step(self.device, step)
        if self.pending is not None:
            self._settle_checkpoint(only_if_done=True)
        if self.ckpt_every and step % self.ckpt_every == 0:
            self._safety_checkpoint(step)
        if loss is not None and self.trainer.dp == 0 and self.trainer.tp == 0:
            self.ctl.set_loss(step, loss, str(self.trainer.cfg))
        if loss is not None and self.args.loss_file and self.trainer.dp == 0 and self.trainer.tp == 0:
            with open(self.args.loss_file, "a") as f:
                f.write(f"{step} {loss!r} {self.trainer.cfg}\n")
        if loss is not None and self.trainer.dp == 0 and self.trainer.tp == 0 and self.args.log_every \
                and step % self.args.log_every == 0:
            self.log(f"step {step} loss {loss:.6f}")
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)


class _Broken(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        device, local, gpn = device_from_env()
        ctl = C.Control.from_env()
    except RuntimeError as exc:
        print(f"launcher.worker: error: {exc}", file=sys.stderr)
        return 2
    ctl.hello(device)  # a live-mode program: the launcher waits for it to register
    worker = None
    try:
        worker = Worker(args, ctl, device, local, gpn)
        rc = worker.run()
    except Exception:
        traceback.print_exc()
        rc = 1
    # Skip the interpreter's teardown: DCP leaves gloo threads that can SIGABRT it (facts.md), and a
    # departing worker's teardown takes CPU from the new layout's first steps (2 cores, many workers).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
