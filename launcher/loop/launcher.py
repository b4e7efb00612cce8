"""The control loop of one job: it watches the workers, requests and signals, and decides what each trigger does.

It hosts the control plane (launcher.wire.control), starts one set of workers per node through its
node backend (launcher.backends), then turns every trigger -- an admin request
(launcher.loop.requests), USR1, a worker that dies -- into a decision: which nodes the job should run
on. The job's mode carries a decision out the same way for every trigger: a live move
(launcher.loop.live, failures through launcher.loop.recovery) or a restart (launcher.loop.restart).
What the job holds, its workers and its history are launcher.loop.holdings, .workers and .recorder.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from launcher.backends import AcquireFailed, CannotAcquire, NodeBackend
from launcher.loop import live_plan, recovery, requests
from launcher.loop.holdings import Holdings
from launcher.loop.live import LiveMode
from launcher.loop.outcome import MigrationFailed, Outcome
from launcher.loop.recorder import Recorder
from launcher.loop.restart import RestartMode
from launcher.loop.start_request import StartRequest, checkpoint_dir
from launcher.loop.suspend import continue_job, finish_resume, queue_successor, resume_point, takeover
from launcher.loop.workers import Workers
from launcher.options import Options
from launcher.wire import control as C
from launcher.wire.folders import latest_checkpoint
from migrate.layout import LayoutError
from migrate.topology import RankMap
from service.identity import local_user


def grow_choice(active: Sequence[str], alloc: Sequence[str], gone: set[str] | frozenset[str],
                want: int) -> tuple[list[str], int]:
    """How to reach `want` nodes: (idle nodes of the allocation to start workers on, how many more
    nodes the backend must acquire). Released nodes (`gone`) never come back to the allocation."""
    idle = [x for x in alloc if x not in set(active) and x not in gone]
    more = max(want - len(active), 0)
    take = idle[:more]
    return take, more - len(take)


class Launcher:
    """The control loop: one instance per job, in the batch step (or in `elastic demo`)."""

    def __init__(self, opts: Options, backend: NodeBackend, store, *, slurm_job_id: str | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.opts, self.backend, self.db, self.slurm_job_id = opts, backend, store, slurm_job_id
        self.recorder = Recorder(store, log)
        self.log, self.reporter = self.recorder.log, self.recorder.reporter
        self.holdings = Holdings(opts, backend, self.recorder)
        self.workers = Workers(backend, self.holdings, self.log)
        self.gpn, self.alloc, self.index = self.holdings.gpn, self.holdings.alloc, self.holdings.index
        self.ckpt_dir = checkpoint_dir(opts, store.url if store else None)
        self.ctl: C.Control | None = None
        self.request: StartRequest | None = None  # built once the control plane has its port
        self.mode: LiveMode | RestartMode = self._live_mode()
        self.deciding = False  # auto mode: restart mode until the workers join through launcher.runtime
        self.signalled = self.stopped = False
        self.last_step = 0  # the last finished step recorded in the database

    def _live_mode(self) -> LiveMode:
        mode = LiveMode(self.opts, self.ctl, self.holdings, self.workers, self.recorder, self.start_nodes)
        mode.ckpt_dir = self.ckpt_dir
        return mode

    # -- what tests, the demo and the bench read --------------------------------------------------------
    job_id = property(lambda self: self.recorder.job_id, lambda self, v: setattr(self.recorder, "job_id", v))
    outcomes = property(lambda self: self.recorder.outcomes)
    active = property(lambda self: self.workers.active)
    gone = property(lambda self: self.holdings.gone)
    lost = property(lambda self: self.workers.lost)
    live = property(lambda self: isinstance(self.mode, LiveMode) and self.mode.epoch >= 0)
    restarts = property(lambda self: self.mode if isinstance(self.mode, RestartMode) else None)
    epoch = property(lambda self: getattr(self.mode, "epoch", -1))
    world = property(lambda self: getattr(self.mode, "world", "w0"))
    suspended = property(lambda self: getattr(self.mode, "suspended", False))
    model = property(lambda self: self.holdings.model)
    tp_fit = property(lambda self: self.holdings.tp_fit)
    node_devices = property(lambda self: self.holdings.node_devices)
    handles = property(lambda self: self.workers.handles, lambda self, v: setattr(self.workers, "handles", v))
    topology = property(lambda self: self.holdings.topology, lambda self, v: setattr(self.holdings, "topology", v))
    current = property(lambda self: self.mode.current, lambda self, v: setattr(self.mode, "current", v))

    def max_step(self) -> int:
        devs = list(self.current.devices) if self.current else []
        return max(self.ctl.steps(devs).values(), default=0)

    def _keep_order(self) -> list[str]:
        return self.holdings.keep_order(self.active, self.current.devices)

    # -- start ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Host the control plane, start the workers on the first nodes, post the first layout."""
        self.ctl = C.Control(self.opts.master_addr, self.opts.master_port, server=True,  # listening there only,
                             on_refused=self.log)  # answering only the processes started with the job's secret
        self.mode.ctl = self.ctl
        self.log(f"control plane on {self.opts.master_addr}:{self.ctl.port} (the job's processes only); "
                 f"{self.backend.describe()}")
        self.request = StartRequest.for_job(self.opts, self.db.url, self.ctl.port, self.backend)
        largest = max((self.holdings.devices_on([n]) for n in self.alloc), default=self.gpn)
        self.ctl.set_shapes(live_plan.shapes(self.opts, self.holdings.tp_fit, largest))
        nodes = self.alloc[:self.opts.max_nodes]
        mode = self.opts.mode
        if mode == "auto" and (self.opts.model is not None or self.opts.resume
                               or "launcher.worker" in self.opts.command):
            mode = "live"  # the reference worker (python -m launcher.worker) registers
        if mode != "live":
            self.start_restart_mode(nodes, deciding=mode == "auto")
            return
        self.start_nodes(nodes, 0)
        self.workers.wait_ready(self.ctl, nodes, self.opts.ready_timeout)
        self.go_live(nodes)

    def start_nodes(self, nodes: list[str], first_event: int) -> None:
        """Start the workers of `nodes` from the start request; they handle events from `first_event` on."""
        for n in nodes:
            self.ctl.forget_workers(self.node_devices(n))  # earlier workers of this node (a grow after a shrink)
            self.log(f"starting workers on {n}")
            self.workers.start(n, self.request.env(first_event), self.request.command)

    def _create_job(self, layout: str, nodes: list[str], max_devices: int, **extra) -> None:
        """The job's record, owned by this launcher's Unix user (the shared service takes the owner from the
        launcher's munge credential instead)."""
        owner, owner_uid = local_user()
        self.recorder.job_id = self.db.create_job(
            self.opts.job_name, layout, self.gpn, max_devices, slurm_job_id=self.slurm_job_id,
            pinned_node=self.backend.batch_node, nodes=nodes, min_nodes=self.opts.min_nodes,
            max_nodes=self.opts.max_nodes, owner=owner, owner_uid=owner_uid, **self.holdings.node_shapes(nodes),
            **extra)

    def start_restart_mode(self, nodes: list[str], deciding: bool) -> None:
        """Restart mode (torchrun's contract): the job is registered at once, every worker started as one world."""
        self._create_job(f"pp1tp1dp{self.holdings.devices_on(nodes)}", nodes, self.opts.max_nodes * self.gpn,
                         mode="restart")
        self.mode = RestartMode(self.opts, self.ctl, self.holdings, self.workers, self.recorder, self.request.env,
                                Path(f"{self.ckpt_dir}.errors"))
        self.deciding = deciding
        self.mode.start_world(nodes)
        if not deciding:  # auto mode: recorded once it trains as a restart-mode world (RestartMode.record_world)
            self.mode.record_world()
            self.log(f"job {self.job_id}: restart mode, {self.current.layout} on {','.join(nodes)}")
        else:  # nothing is decided yet: no layout is claimed
            self.log(f"job {self.job_id}: {len(self.current.devices)} workers on {','.join(nodes)}: live mode if "
                     f"they join through launcher.runtime, else restart mode ({self.current.layout})")

    def went_live(self) -> bool:
        """Auto mode: once a worker joined through launcher.runtime, the job runs in live mode from here."""
        if not self.ctl.hellos(self.current.devices):
            return False
        self.log("the workers use the runtime API: live mode")
        nodes = self.active
        self.workers.wait_ready(self.ctl, nodes, self.opts.ready_timeout)
        self.mode.close()
        self.recorder.epoch_base, self.deciding = self.mode.count + 1, False
        self.mode = self._live_mode()
        self.go_live(nodes)
        return True

    def go_live(self, nodes: list[str]) -> None:
        """The workers registered: pick the layout, post it (event 0), record the job."""
        mode, h = self.mode, self.holdings
        # the reference GPT (python -m launcher.worker) among them: its layouts are checked against its
        # ModelSpec, read from the command line as --layouts was (options.model_from_command)
        h.model = live_plan.known_model(self.opts)
        self.log(f"live mode, layouts by node count: {h.layouts_said()}" + (
            f"; the runtime's own lines (migrations, checkpoints) go to {self.request.runtime_log}/runtime-dev<D>.log"
            if self.request.runtime_log else ""))
        layout = h.choose(h.devices_on(nodes))
        if (note := h.idle_note(h.devices_on(nodes), layout)) is not None:
            self.log(note)
        mode.current = RankMap(layout, live_plan.start_devices(self.ctl.model(), h.topology, self.opts.placement,
                                                                layout, nodes))
        devices = mode.current.devices
        job, path, requests_ = resume_point(self.opts, self.recorder, self.ckpt_dir)
        mode.post({"kind": "start", "layout": str(layout), "devices": list(devices),
                   **({"checkpoint": path} if path else {})})
        if self.job_id is not None:  # auto mode: registered in restart mode until the workers joined
            self.db.update_job(self.job_id, mode="live", layout=str(layout))
        elif job is None:
            self._create_job(str(layout), nodes, h.devices_on(nodes) + (self.opts.max_nodes - len(nodes)) * self.gpn)
        else:  # the same job goes on: its history, requests and epochs continue
            self.recorder.job_id = job.id
            continue_job(self.recorder, h, self.opts, job, nodes, self.slurm_job_id)
        self.recorder.rank_map(0, str(layout), h.entries(mode.current), update_job=False)
        queue_successor(self.opts, self.backend, self.log, self.recorder.audit)
        mode.record_survival()
        self.log(f"job {self.job_id}: {layout} on {len(devices)} devices of {','.join(nodes)}")
        if path:
            finish_resume(mode, path, requests_, job if self.opts.requeued else None,
                          takeover(self.opts) if self.opts.successor_of else "")

    # -- decisions: which nodes next ------------------------------------------------------------------
    def migrate_to(self, target: list[str], trigger: str, **how) -> Outcome:
        """Move the job onto the nodes `target` (pinned node included) with the next layout."""
        return self.mode.migrate_to(target, trigger, **how)

    def shrink_to(self, n: int, trigger: str) -> Outcome:
        return self.migrate_to(self._keep_order()[:max(n, self.opts.min_nodes)], trigger)

    def grow_to(self, n: int, trigger: str) -> Outcome:
        n = min(n, self.opts.max_nodes)
        take, missing = grow_choice(self.active, self.alloc, self.gone, n)
        if not missing:
            return self.migrate_to(self.active + take, trigger)
        got = self._acquire(missing, n, trigger, len(take))
        if isinstance(got, Outcome):
            return got
        extra = list(got.nodes)
        out = self.migrate_to(self.active + take + extra, trigger,
                              ready_timeout=max(got.deadline - time.monotonic(), 30.0), note=f" ({got.label})")
        on_it = {self.holdings.node_of(d) for d in self.current.devices} & set(extra)
        if not out.ok and not on_it:  # the grow did not happen: give the acquired nodes back
            self.workers.kill(extra)
            self.backend.abandon(got, f"the grow failed: {out.message}", self.reporter)
            for x in extra:
                self.recorder.node_state(x, "released")
            out.message = f"{out.message} ({got.label} cancelled)"
        return out

    def _acquire(self, count: int, want: int, trigger: str, idle: int):
        """Ask the backend for `count` more nodes (NodeBackend.acquire), added to the holdings: the Acquired
        nodes, or the failed Outcome (recorded as a failed migration when the backend tried and failed)."""
        exclude = [x for x in self.alloc if x not in self.gone]  # nodes held now: new ones must be others
        n = len(self.active)
        out = Outcome(trigger, False, "", from_layout=str(self.current.layout), nodes_before=n, nodes_after=n)
        try:
            got = self.backend.acquire(count, job_name=self.opts.job_name, exclude=exclude,
                                       timeout=self.opts.companion_timeout, report=self.reporter,
                                       whole=trigger == "policy")  # it counted whole idle nodes
        except CannotAcquire as exc:
            out.message = f"only {idle} idle node(s) left in the allocation; {exc}"
            return self.recorder.keep(out)
        except AcquireFailed as exc:
            try:
                to_layout = str(self.holdings.choose(want * self.gpn))
            except LayoutError:
                to_layout = "?"
            return self.recorder.refuse(out, str(exc), to_layout, {"nodes_requested": count})
        self.holdings.add(got.nodes)
        return got

    def preempt(self, nodes: list[str], trigger: str) -> Outcome:
        if self.backend.batch_node in nodes:
            n = len(self.active)
            return self.recorder.keep(Outcome(trigger, False, f"{self.backend.batch_node} runs the batch step and "
                                              "cannot be given back", from_layout=str(self.current.layout),
                                              nodes_before=n, nodes_after=n))
        return self.migrate_to([n for n in self.active if n not in nodes], trigger)

    def handle_request(self, req) -> None:
        requests.handle_request(self, req)

    def suspend(self, trigger: str) -> Outcome:
        """The last devices must go: every worker writes its state at one agreed step, then all exit (suspend.py)."""
        out = self.mode.suspend(trigger)
        if isinstance(self.mode, LiveMode):  # its workers ended, suspended or not
            self.stopped = True
        return out

    # -- the loop -------------------------------------------------------------------------------------
    def stop(self, suspend: bool = False) -> None:
        """Stop every worker at one step boundary (suspend=True: write the state first, see suspend)."""
        if suspend:
            self.suspend("signal")
            return
        self.mode.stop()
        self.stopped = True

    def poll_once(self) -> bool:
        """One round of checks; False once the job is over."""
        self.recorder.heartbeat(lambda: latest_checkpoint(self.ckpt_dir) if isinstance(self.mode, LiveMode) else None)
        if said := self.backend.keep_successor():  # held back while this launcher lives (slurm.successor)
            self.log(said)
        if self.deciding and self.went_live():
            return True
        going = self.mode.poll() if isinstance(self.mode, RestartMode) else self._poll_live()
        if not going:
            self.stopped = True
            return False
        if self.signalled:
            self.signalled = False
            if self.opts.on_signal == "suspend" and isinstance(self.mode, LiveMode):
                self.log("USR1: suspending")
                self.suspend("signal")
                return False
            if self.opts.on_signal != "ignore" and len(self.active) > self.opts.min_nodes:
                self.shrink_to(self.opts.min_nodes, "signal")
        self.record_loss()
        for req in self.db.take_requests(self.job_id):  # claimed one at a time (SKIP LOCKED)
            self.handle_request(req)
            if self.stopped:
                return False
        return True

    def _poll_live(self) -> bool:
        if (step := self.max_step()) != self.last_step:  # what `elastic jobs` shows
            self.last_step = step
            self.db.update_job(self.job_id, last_step=step)
        self.mode.watch(step)
        exited = self.workers.exited()
        dead = {d: rc for d, rc in exited.items() if rc != 0}
        gone = {} if dead else self.mode.probe.gone(self.mode.world, list(self.current.devices))
        if dead or gone:  # a worker ended badly, or a node vanished without its workers being seen to end
            if (why := self.ctl.given_up()) is not None:  # the workers ended it on purpose: no recovery helps
                self.log(f"stopping the job: {why}")
                self.workers.kill_all()
                self.recorder.job_state("failed", why=why)
                return False
            out = recovery.lose_nodes(self.mode, gone) if gone else recovery.recover(self.mode, dead)
            if not out.ok:
                self.log(f"cannot recover: {out.message}; stopping the job")
                self.workers.kill_all()
                self.recorder.job_state("failed", why=out.message)
            return out.ok
        if (devices := set(self.current.devices)) and devices <= set(exited):  # they finished on their own (--steps)
            self.log("workers finished")
            self.mode.post({"kind": "stop"})  # standby workers
            self.mode.finish_all("finished", timeout=30)
            return False
        return True

    def record_loss(self) -> None:
        """Copy every step the workers reported since the last poll (step, loss, layout) into the database; in
        restart mode they also say the job's step and where a restart went on from (RestartMode.reported)."""
        new = self.recorder.take_steps(self.ctl)
        if isinstance(self.mode, RestartMode):
            self.mode.reported(new)

    def run(self, until: Callable[["Launcher"], bool] | None = None) -> int:
        """Start, then loop until the workers finish, a stop, or `until(self)` says so."""
        old = signal.signal(signal.SIGUSR1, self._on_usr1)
        old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self.start()
            while self.poll_once():
                if until is not None and until(self):
                    self.stop()
                    break
                time.sleep(self.opts.poll)
            self.record_loss()  # the steps since the last poll
            return 0 if self.recorder.job_state_is("finished", "suspended") else 1
        except KeyboardInterrupt:  # SIGINT or SIGTERM: the job ends as stopped, not stuck in running
            self.log("interrupted: stopping the workers")
            if isinstance(self.mode, RestartMode):
                self.mode.stop_world()
            if self.recorder.job_state_is("running"):
                self.recorder.job_state("stopped")
            raise
        finally:
            signal.signal(signal.SIGUSR1, old)
            signal.signal(signal.SIGTERM, old_term)
            for h in self.workers.handles.values():
                h.kill()
            self.backend.close(self.reporter)

    def _on_usr1(self, _sig, _frame) -> None:
        self.log("SIGUSR1 received")
        self.signalled = True

    def _on_term(self, _sig, _frame) -> None:
        raise KeyboardInterrupt
