"""The control loop of one job: it watches the workers, requests and signals, and decides what each trigger does.

It hosts the control plane (launcher.control), starts one set of workers per node through its
node backend (launcher.backends), then turns every trigger -- an admin request
(launcher.admin), USR1, a worker that dies -- into a decision: which nodes the job should run
on. Carrying a decision out is one live move (launcher.runtime_moves.move: plan, record, publish,
commit or veto, release, record), a restore from the safety checkpoint or a refusal
(launcher.transaction.Transaction), the same for every trigger.
"""
from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Sequence

from launcher import admin
from launcher import control as C
from launcher.backends import AcquireFailed, CannotAcquire, NodeBackend, NodeHandle, Reporter
from launcher.options import Options
from launcher.pause import PendingPauses
from launcher.runtime_moves import known_model, shapes
from launcher.start_request import StartRequest, checkpoint_dir
from launcher.survival import auto_checkpoint_every, survival
from launcher.transaction import MigrationFailed, Outcome, TrainingEnded, Transaction


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
        from launcher.policy import tp_fit
        from migrate.topology import Topology

        self.opts, self.backend, self.db = opts, backend, store
        self.gpn = opts.gpus_per_node
        self.alloc = backend.allocation()
        sizes = [backend.gpus_on(n) for n in self.alloc]
        self.topology = Topology.of_nodes(sizes, names=self.alloc, pinned=(backend.batch_node,))
        self.tp_fit = tp_fit(sizes)  # uneven nodes: TP groups that fit every node (gpn when all alike)
        if opts.checkpoint_auto and len(set(sizes)) > 1:  # uneven nodes: the allocation's sizes decide
            opts.checkpoint_every = auto_checkpoint_every(opts.min_nodes, opts.max_nodes, sizes, opts.layouts,
                                                          opts.model, opts.placement)
        self.index = {n: i for i, n in enumerate(self.alloc)}
        self.slurm_job_id = slurm_job_id
        self.log = log or (lambda m: print(f"[elastic-launch] {m}", file=sys.stderr, flush=True))
        self.reporter = Reporter(self.log, lambda action, text: self.db.audit("elastic-launch", action,
                                                                              f"job:{self.job_id}", text))
        self.ctl: C.Control | None = None
        self.handles: dict[str, NodeHandle] = {}
        self.epoch = -1  # last posted event
        self.current = None  # migrate.RankMap of the running layout
        self.model = None
        self.job_id: int | None = None
        self.signalled = False
        self.outcomes: list[Outcome] = []
        self.stopped = False
        self.suspended = False
        self.world = "w0"  # the process-group world the current layout trains in
        self.lost: set[int] = set()  # devices whose worker died on a node that is still up: never used again
        self.pauses = PendingPauses()  # migrations whose pause is known once the new layout commits a step
        self.epoch_base = 0  # database epochs of a resumed job continue after its earlier ones
        self.loss_step = 0  # the last step whose loss is in the database
        self.restarts = None  # launcher.restart.RestartMode while the job runs in restart mode
        self.restores = 0  # live mode: checkpoint restores after failures so far (count against --max-restarts)
        self.deciding = False  # auto mode: restart mode until the workers join through launcher.runtime
        self.live = False  # live mode: the workers joined through launcher.runtime (go_live ran)
        self.last_step = 0  # the last finished step recorded in the database
        self.ckpt_dir = checkpoint_dir(opts, store.url if store else None)
        self.request: StartRequest | None = None  # built once the control plane has its port

    # -- what the job holds ---------------------------------------------------------------------------
    def node_devices(self, node: str) -> list[int]:
        return self.topology.node_devices(node)

    def devices_on(self, nodes: Sequence[str]) -> int:
        """How many devices `nodes` have (nodes may differ)."""
        return sum(len(self.topology.node_devices(n)) for n in nodes)

    @property
    def active(self) -> list[str]:
        return [n for n in self.alloc if n in self.handles]

    @property
    def gone(self) -> set[str]:
        """Nodes given back that the backend never returns (Slurm's released nodes)."""
        if self.db is None or self.job_id is None or self.backend.released_nodes_return:
            return set()
        return {n.name for n in self.db.list_nodes(self.job_id) if n.state in ("released", "failed")}

    def max_step(self) -> int:
        devs = list(self.current.devices) if self.current else []
        return max(self.ctl.steps(devs).values(), default=0)

    def entries(self, rank_map) -> list[dict]:
        """The rank map as database rows."""
        out = []
        for r, d in enumerate(rank_map.devices):
            pp, dp, tp = rank_map.layout.coords(r)
            dev = self.topology.devices[d]
            out.append({"virtual_rank": r, "node": dev.node, "gpu": dev.gpu, "pp": pp, "dp": dp, "tp": tp,
                        "component": self.backend.component_of(dev.node)})
        return out

    def node_shape(self, node: str) -> dict[str, int]:
        """What the database records of a node besides its state: its GPU count and het-job component."""
        return {"gpus": len(self.topology.node_devices(node)), "component": self.backend.component_of(node)}

    def node_shapes(self, nodes: Sequence[str]) -> dict[str, dict[str, int]]:
        """`create_job`'s node_gpus and components for `nodes`."""
        shapes = {n: self.node_shape(n) for n in nodes}
        return {"node_gpus": {n: s["gpus"] for n, s in shapes.items()},
                "components": {n: s["component"] for n, s in shapes.items()}}

    def choose(self, devices: int):
        """The layout on `devices` devices (launcher.runtime_moves.choose)."""
        from launcher import runtime_moves

        return runtime_moves.choose(self, devices)

    def launch_spec(self) -> dict:
        """What the dashboard's dry run of a preempt needs without importing the launcher: the model,
        the node range, and the layout this job's policy picks for every node count in it."""
        from migrate.layout import LayoutError

        layouts = {}
        for n in range(self.opts.min_nodes, self.opts.max_nodes + 1):
            devices = self.devices_on(self.alloc[:n])
            try:
                layouts[str(devices)] = str(self.choose(devices))
            except LayoutError:
                continue
        from launcher.worker import model_info

        return {"model": model_info(self.model), "min_nodes": self.opts.min_nodes, "max_nodes": self.opts.max_nodes,
                "gpus_per_node": self.gpn, "layouts": layouts, "placement": self.opts.placement,
                "checkpoint_every": self.opts.checkpoint_every,
                "survives": survival(self.current.layout, self.current.devices, self._node_of()).as_dict()}

    def _node_of(self) -> dict[int, str]:
        return {d.id: d.node for d in self.topology.devices}

    def record_survival(self) -> None:
        """Say what the running layout survives (the loss of one process, of one node): in the log, the
        audit log, and the job's launch spec (which the dashboard reads)."""
        said = survival(self.current.layout, self.current.devices, self._node_of()).describe()
        self.log(f"job {self.job_id}: {self.current.layout} {said}")
        self.db.audit("elastic-launch", "survival", f"job:{self.job_id}", f"{self.current.layout} {said}")
        if self.model is not None:  # the dashboard's dry run plans the reference GPT only
            self.db.set_launch_spec(self.job_id, self.launch_spec())

    def record_loss(self) -> None:
        """Copy the latest step the workers reported (loss, layout) into the database, once per step."""
        rep = self.ctl.loss()
        if rep and rep["step"] != self.loss_step:  # a restore from a checkpoint goes back
            self.loss_step = rep["step"]
            self.db.record_step(self.job_id, rep["step"], rep["loss"], rep["layout"])

    # -- the workers ----------------------------------------------------------------------------------
    def start_nodes(self, nodes: list[str], first_event: int) -> None:
        """Start the workers of `nodes` from the start request; they handle events from `first_event` on."""
        for n in nodes:
            for d in self.node_devices(n):  # registrations of earlier workers of this node (a grow after a shrink)
                self.ctl.store.delete_key(f"ready/{d}")
            self.log(f"starting workers on {n}")
            self.handles[n] = self.backend.start(n, self.index[n], self.request.env(first_event), self.request.command)
            if self.handles[n].devices != self.node_devices(n):  # the backend numbers devices as the topology does
                raise MigrationFailed(f"workers on {n} started as devices {self.handles[n].devices}, the topology "
                                      f"has {self.node_devices(n)}")

    def wait_ready(self, nodes: list[str], timeout: float | None = None, note: str = "") -> None:
        devs = [d for n in nodes for d in self.node_devices(n)]
        timeout = self.opts.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            ready = self.ctl.ready(devs)
            if len(ready) == len(devs) and self.ctl.model() is not None:
                return
            for n in nodes:
                bad = {d: rc for d, rc in self.handles[n].exited().items() if d not in ready}
                if bad:
                    raise MigrationFailed(f"workers on {n}{note} exited before registering (exit codes {bad}); "
                                          f"{self.log_hint(bad)}")
            if time.monotonic() > deadline:
                from launcher.runtime import JOIN_CALL

                late = sorted(set(devs) - set(ready))
                raise MigrationFailed(f"workers {late}{note} did not register within {timeout:.0f} s: a live-mode "
                                      f"program must call {JOIN_CALL} (or run in restart mode); {self.log_hint(late)}")
            time.sleep(0.1)

    def wait_results(self, e: int, participants: list[int]) -> dict[int, dict]:
        """Every participant's result of event `e`; vetoes the commit when one dies or time runs out.
        TrainingEnded when workers of the running layout exited with 0 instead: they finished their last
        step before the event could apply (e.g. a grow that took seconds to start its workers)."""
        deadline = time.monotonic() + self.opts.migrate_timeout
        while True:
            if self.ctl.reported(e, participants):
                return self.ctl.results(e, participants)
            dead = {d: rc for d, rc in self.dead(all_codes=True).items() if d in participants}
            if dead:  # a worker that reported, then exited, is not dead
                dead = {d: rc for d, rc in dead.items() if not self.ctl.results(e, [d])}
            late = time.monotonic() > deadline
            if (dead or late) and self.ctl.veto(f"ev/{e}/commit"):
                # every participant had voted yes already: the new layout stands
                return self._results_after_commit(e, participants, dead, deadline)
            if dead and not any(dead.values()) and set(dead) <= set(self.current.devices):
                raise TrainingEnded(f"declined: training ended (the workers finished their last step, step "
                                    f"{self.max_step()}) before the migration could apply")
            if dead:
                raise MigrationFailed(f"workers {sorted(dead)} exited during the migration (exit codes "
                                      f"{sorted(set(dead.values()))}); old layout kept")
            if late:
                silent = sorted(set(participants) - set(self.ctl.results(e, participants)))
                raise MigrationFailed(f"no result from devices {silent} within {self.opts.migrate_timeout:.0f} s "
                                      f"({self.ctl.where_workers_are(e, participants)})")
            time.sleep(0.05)

    def _results_after_commit(self, e: int, participants: list[int], dead: dict[int, int],
                              deadline: float) -> dict[int, dict]:
        self.ctl.abort_world(f"w{e}")  # survivors stop waiting for the dead to join it
        alive = [d for d in participants if d not in dead]
        while not self.ctl.reported(e, alive) and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        self.log(f"workers {sorted(dead)} died after the migration committed; new layout kept")
        return self.ctl.results(e, alive)

    @staticmethod
    def check_results(results: dict[int, dict]) -> dict[int, dict]:
        """Raise MigrationFailed with the first worker error among `results`."""
        bad = [r.get("error") for r in results.values() if not r.get("ok")]
        if bad:
            raise MigrationFailed(bad[0])
        return results

    def log_hint(self, devices) -> str:
        """Where the output of these workers went, for error messages."""
        log_dir = getattr(self.backend, "log_dir", None)
        if log_dir is None:
            return "their output went to elastic-launch's own (no --log-dir)"
        from launcher.backends.local import LocalNodes

        if not isinstance(self.backend, LocalNodes):  # one srun step (and log) per node
            nodes = sorted({self.topology.devices[d].node for d in devices})
            return "see " + ", ".join(str(log_dir / f"step-{n}.log") for n in nodes)
        return "see " + ", ".join(str(log_dir / f"worker-dev{d}.log") for d in sorted(devices))

    def dead(self, all_codes: bool = False) -> dict[int, int]:
        """device -> exit code of workers that ended (with an error, unless all_codes)."""
        return {d: rc for d, rc in self.exited().items() if all_codes or rc != 0}

    def exited(self) -> dict[int, int]:
        """device -> exit code of the workers that ended, but for those already counted as lost."""
        return {d: rc for h in self.handles.values() for d, rc in h.exited().items() if d not in self.lost}

    def reap(self, node: str, timeout: float = 60.0) -> None:
        """Let the workers of `node` exit on their own, then kill what is left."""
        h = self.handles.pop(node, None)
        if h is not None and not self.backend.stop(h, timeout):
            self.log(f"workers on {node} did not exit within {timeout:.0f} s; killed them")

    def resume_old(self, failed: Sequence[int]) -> None:
        """A migration did not commit: every participant kept its old state. When no worker of the old
        layout died, they train on again in a fresh world (event `resume`); otherwise the dead workers
        are found by the next poll and recovered from (on_failure)."""
        if failed or self.dead():
            return
        self.epoch += 1
        self.world = f"w{self.epoch}"
        self.ctl.post({"epoch": self.epoch, "kind": "resume", "layout": str(self.current.layout),
                       "devices": list(self.current.devices)})
        self.log(f"event {self.epoch}: resume {self.current.layout} on its old devices")

    # -- start ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Host the control plane, start the workers on the first nodes, post the first layout."""
        self.ctl = C.Control("0.0.0.0" if self.opts.master_addr not in ("127.0.0.1", "localhost") else "127.0.0.1",
                             self.opts.master_port, server=True)
        self.log(f"control plane on {self.opts.master_addr}:{self.ctl.port}; {self.backend.describe()}")
        self.request = StartRequest.for_job(self.opts, self.db.url, self.ctl.port)
        self.ctl.set_json(C.KEY_SHAPES, shapes(self))
        nodes = self.alloc[:self.opts.max_nodes]
        mode = self.opts.mode
        if mode == "auto" and (self.opts.model is not None or self.opts.resume
                               or "launcher.worker" in self.opts.command):
            mode = "live"  # the reference worker (python -m launcher.worker) registers
        if mode != "live":
            self.start_restart_mode(nodes, deciding=mode == "auto")
            return
        self.start_nodes(nodes, 0)
        self.wait_ready(nodes)
        self.go_live(nodes)

    def start_restart_mode(self, nodes: list[str], deciding: bool) -> None:
        """Restart mode (torchrun's contract): the job is registered at once, every worker started as one world."""
        from launcher.restart import RestartMode

        self.job_id = self.db.create_job(self.opts.job_name, f"pp1tp1dp{self.devices_on(nodes)}", self.gpn,
                                         self.opts.max_nodes * self.gpn, slurm_job_id=self.slurm_job_id,
                                         pinned_node=self.backend.batch_node, nodes=nodes, mode="restart",
                                         min_nodes=self.opts.min_nodes, max_nodes=self.opts.max_nodes,
                                         **self.node_shapes(nodes))
        self.restarts, self.deciding = RestartMode(self), deciding
        self.restarts.start_world(nodes)
        self.db.record_rank_map(self.job_id, 0, str(self.current.layout), self.entries(self.current))
        self.log(f"job {self.job_id}: restart mode, {self.current.layout} on {','.join(nodes)}")

    def went_live(self) -> bool:
        """Auto mode: once a worker joined through launcher.runtime, the job runs in live mode from here."""
        if not self.ctl.hellos(self.current.devices):
            return False
        self.log("the workers use the runtime API: live mode")
        nodes = self.active
        self.wait_ready(nodes)
        self.restarts.close()
        self.restarts, self.deciding, self.epoch_base = None, False, self.restarts.count + 1
        self.go_live(nodes)
        return True

    def go_live(self, nodes: list[str]) -> None:
        """The workers registered: pick the layout, post it (event 0), record the job."""
        from launcher.resume import continue_job, resume_point
        from migrate.topology import RankMap

        self.live = True  # every live-mode program joins through launcher.runtime
        # the reference GPT (python -m launcher.worker) among them: its layouts are checked against its
        # ModelSpec, read from the command line as --layouts was (options.model_from_command)
        self.model = known_model(self)
        layout = self.choose(self.devices_on(nodes))
        self.current = RankMap(layout, self._start_devices(layout, nodes))
        devices = self.current.devices
        self.epoch = 0
        job, path, requests = resume_point(self)
        ev = {"epoch": 0, "kind": "start", "layout": str(layout), "devices": list(devices)}
        if path:
            ev["checkpoint"] = path
        self.ctl.post(ev)
        if self.job_id is not None:  # auto mode: registered in restart mode until the workers joined
            self.db.update_job(self.job_id, mode="live", layout=str(layout))
        elif job is None:
            self.job_id = self.db.create_job(self.opts.job_name, str(layout), self.gpn,
                                             self.devices_on(nodes) + (self.opts.max_nodes - len(nodes)) * self.gpn,
                                             slurm_job_id=self.slurm_job_id,
                                             pinned_node=self.backend.batch_node, nodes=nodes,
                                             min_nodes=self.opts.min_nodes, max_nodes=self.opts.max_nodes,
                                             **self.node_shapes(nodes))
        else:  # the same job goes on: its history, requests and epochs continue
            self.job_id = job.id
            continue_job(self, job, nodes)
        self.db.record_rank_map(self.job_id, self.epoch_base, str(layout), self.entries(self.current))
        self.record_survival()
        self.log(f"job {self.job_id}: {layout} on {len(devices)} devices of {','.join(nodes)}")
        if path:
            from launcher.resume import finish_resume

            finish_resume(self, path, requests)

    def _start_devices(self, layout, nodes: list[str]) -> tuple[int, ...]:
        """Where the ranks start: in device order (--placement packed, or DP = 1), else where the
        planner's resilient placement puts them (no node holds every replica of a stage)."""
        from launcher import runtime_moves
        from migrate.topology import RankMap

        devices = tuple(d for n in nodes for d in self.node_devices(n))[:layout.world_size]
        if self.opts.placement == "packed" or layout.dp < 2:
            return devices
        # the workers' state manifests are the byte workload
        return runtime_moves.placement(self, layout, RankMap(layout, devices), nodes)

    # -- decisions: which nodes next ------------------------------------------------------------------
    def migrate_to(self, target: list[str], trigger: str, failed: Sequence[int] = (),
                   ready_timeout: float | None = None, note: str = "") -> Outcome:
        """Move the job onto the nodes `target` (pinned node included) with the next layout."""
        if self.restarts is not None:
            return self.restarts.restart_to(target, trigger)
        from launcher import runtime_moves

        return runtime_moves.move(self, target, trigger, failed, ready_timeout, note)

    def shrink_to(self, n: int, trigger: str) -> Outcome:
        n = max(n, self.opts.min_nodes)
        return self.migrate_to(self._keep_order()[:n], trigger)

    def _keep_order(self) -> list[str]:
        """Active nodes, the pinned batch node first, then in the backend's order (NodeBackend.keep_rank:
        e.g. a job's own nodes before a companion job's), then those running most ranks."""
        used: dict[str, int] = {}
        for d in self.current.devices:
            node = self.topology.devices[d].node
            used[node] = used.get(node, 0) + 1
        return sorted(self.active, key=lambda n: (n != self.backend.batch_node, self.backend.keep_rank(n),
                                                  -used.get(n, 0), self.index[n]))

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
        on_it = {self.topology.devices[d].node for d in self.current.devices} & set(extra)
        if not out.ok and not on_it:  # the grow did not happen: give the acquired nodes back
            for x in extra:
                h = self.handles.pop(x, None)
                if h is not None:
                    h.kill()
            self.backend.abandon(got, f"the grow failed: {out.message}", self.reporter)
            for x in extra:
                self.db.set_node_state(self.job_id, x, "released")
            out.message = f"{out.message} ({got.label} cancelled)"
        return out

    def _acquire(self, count: int, want: int, trigger: str, idle: int):
        """Ask the backend for `count` more nodes (NodeBackend.acquire) and add them to the topology.
        Returns the Acquired nodes, or the failed Outcome (recorded as a failed migration when the
        backend tried and failed)."""
        from migrate.layout import LayoutError
        from migrate.topology import Device, Topology

        exclude = [x for x in self.alloc if x not in self.gone]  # nodes held now: new ones must be others
        try:
            got = self.backend.acquire(count, job_name=self.opts.job_name, exclude=exclude,
                                       timeout=self.opts.companion_timeout, report=self.reporter)
        except CannotAcquire as exc:
            return Transaction(self, trigger).decline(f"only {idle} idle node(s) left in the allocation; {exc}")
        except AcquireFailed as exc:
            try:
                to_layout = str(self.choose(want * self.gpn))
            except LayoutError:
                to_layout = "?"
            return Transaction(self, trigger).refuse(str(exc), to_layout, {"nodes_requested": count})
        new = [x for x in got.nodes if x not in self.index]
        if new:
            base = len(self.topology.devices)
            sizes = [self.backend.gpus_on(x) for x in new]
            devices = tuple(Device(base + sum(sizes[:i]) + g, x, g) for i, x in enumerate(new) for g in range(sizes[i]))
            self.topology = Topology(self.topology.devices + devices, self.topology.pinned)
            for x in new:
                self.index[x] = len(self.alloc)
                self.alloc.append(x)
        for x in got.nodes:
            # held again (a released name may come back)
            self.db.set_node_state(self.job_id, x, "idle", **self.node_shape(x))
        return got

    def preempt(self, nodes: list[str], trigger: str) -> Outcome:
        if self.backend.batch_node in nodes:
            return Transaction(self, trigger).decline(
                f"{self.backend.batch_node} runs the batch step and cannot be given back")
        return self.migrate_to([n for n in self.active if n not in nodes], trigger)

    def handle_request(self, req) -> None:
        admin.handle_request(self, req)

    def on_failure(self, dead: dict[int, int]) -> Outcome:
        """Workers died: re-plan from the surviving replicas. A worker's death fails its device; the
        whole node fails only when it is gone (every worker of it ended: its step ended)."""
        self.log(f"workers {sorted(dead)} died (exit codes {sorted(set(dead.values()))})")
        hit = sorted({self.topology.devices[d].node for d in dead})
        gone = [n for n in hit if n not in self.handles or self.handles[n].all_exited()]
        for n in gone:
            h = self.handles.pop(n, None)
            if h is not None:
                h.kill()
            self.db.set_node_state(self.job_id, n, "failed")
        for d in sorted(d for d in dead if self.topology.devices[d].node not in gone):
            self.lost.add(d)
            self.db.audit("elastic-launch", "failure", f"job:{self.job_id}",
                          f"device {d} on {self.topology.devices[d].node} failed (its worker died); the node stays")
        failed = [d for d in self.current.devices if d in self.lost or self.topology.devices[d].node not in self.handles]
        keep = list(self.active)
        if not keep:
            return Transaction(self, "failure").refuse("no node left")
        if self.opts.checkpoint_every and self._state_lost(failed):
            found = C.latest_checkpoint(self.ckpt_dir)
            if found and self.restores >= self.opts.max_restarts:
                return Transaction(self, "failure").refuse(
                    f"workers {sorted(dead)} kept failing: --max-restarts {self.opts.max_restarts} is used up by "
                    f"restores from the safety checkpoint; raise --max-restarts or fix the worker, then resume "
                    f"from {found[0]} with `elastic-launch --resume`")
            if found:
                self.restores += 1
                return self.restore(keep, *found)
            self.log(f"no complete safety checkpoint in {self.ckpt_dir} yet")
        return self.migrate_to(keep, "failure", failed=failed)

    def _state_lost(self, failed: Sequence[int]) -> bool:
        """True when some (pp, tp) slice of the state has no surviving DP replica."""
        lay = self.current.layout
        need = {(pp, tp) for pp, _dp, tp in map(lay.coords, range(lay.world_size))}
        have = {(lay.coords(r)[0], lay.coords(r)[2]) for r, d in enumerate(self.current.devices) if d not in failed}
        return bool(need - have)

    def restore(self, keep: list[str], path: str, step: int) -> Outcome:
        """Restart the workers on the nodes `keep` from the safety checkpoint of `step`."""
        return Transaction(self, "failure").restore(keep, path, step)

    # -- the end ------------------------------------------------------------------------------------
    def stop(self, suspend: bool = False) -> None:
        """Stop every worker at one step boundary (suspend=True: write the state first, see suspend)."""
        if suspend:
            self.suspend("signal")
            return
        if self.restarts is not None:
            self.restarts.stop_world()
            self.stopped = True
            self.db.set_job_state(self.job_id, "stopped")
            return
        self.epoch += 1
        self.ctl.post({"epoch": self.epoch, "kind": "stop"})
        self.finish_all("finished", timeout=120)

    def suspend(self, trigger: str) -> Outcome:
        """The last devices must go: every training worker writes its part of the state at one agreed step
        boundary into the checkpoint folder, then all exit; the job is recorded as suspended there."""
        if self.restarts is not None:
            return Transaction(self, trigger).decline("suspend needs the job's own checkpoints; in "
                                                      "restart mode the program keeps its own (stop the job instead)")
        from launcher.resume import suspend

        return suspend(self, trigger)

    def finish_all(self, state: str | None, timeout: float) -> None:
        """Every worker ends (standby ones on a stop event); the job is recorded in `state` (None: left as is)."""
        for n in list(self.handles):
            self.reap(n, timeout=timeout)
        self.pauses.settle(self.ctl, self.db, self.log)
        self.stopped = True
        if state is not None:
            self.db.set_job_state(self.job_id, state)

    # -- the loop -------------------------------------------------------------------------------------
    def poll_once(self) -> bool:
        """One round of checks; False once the job is over."""
        if self.restarts is not None:
            if self.deciding and self.went_live():
                return True
            return self.restarts.poll_once()
        step = self.max_step()
        if step != self.last_step:  # what `elastic jobs` shows
            self.last_step = step
            self.db.update_job(self.job_id, last_step=step)
        self.pauses.settle(self.ctl, self.db, self.log)
        exited = self.exited()
        layout_devs = set(self.current.devices)
        if exited and any(rc != 0 for rc in exited.values()):
            return self._recover({d: rc for d, rc in exited.items() if rc != 0})
        if layout_devs and layout_devs <= set(exited):  # the workers finished on their own (--steps)
            self.log("workers finished")
            self.epoch += 1
            self.ctl.post({"epoch": self.epoch, "kind": "stop"})  # standby workers
            self.finish_all("finished", timeout=30)
            return False
        if self.signalled:
            self.signalled = False
            if self.opts.on_signal == "shrink":
                if len(self.active) > self.opts.min_nodes:
                    self.shrink_to(self.opts.min_nodes, "signal")
            elif self.opts.on_signal == "suspend":
                self.log("USR1: suspending")
                self.suspend("signal")
                return False
        self.record_loss()
        for req in self.db.take_requests(self.job_id):  # claimed one at a time (SKIP LOCKED)
            self.handle_request(req)
            if self.stopped:
                return False
        return True

    def _recover(self, dead: dict[int, int]) -> bool:
        """Workers died: recover (on_failure), or stop the job when nothing can be recovered. Deaths
        that come while recovering (the rest of a node going down) are recovered from in turn."""
        self.ctl.abort_world(self.world)  # survivors abandon the step in flight at once
        time.sleep(0.3)  # workers killed together (a whole node) all show up in one recovery
        dead = {**dead, **self.dead()}
        for _ in range(len(self.topology.devices)):
            out = self.on_failure(dead)
            dead = self.dead()
            if out.ok or not dead or not self.handles:
                break
        if out.ok:
            return True
        self.log(f"cannot recover: {out.message}; stopping the job")
        for n in list(self.handles):
            self.handles.pop(n).kill()
        self.stopped = True
        self.db.set_job_state(self.job_id, "failed", why=out.message)
        return False

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
            return 0 if self.db.get_job(self.job_id).state in ("finished", "suspended") else 1
        except KeyboardInterrupt:  # SIGINT or SIGTERM: the job ends as stopped, not stuck in running
            self.log("interrupted: stopping the workers")
            if self.restarts is not None:
                self.restarts.stop_world()
            if self.job_id is not None and self.db.get_job(self.job_id).state == "running":
                self.db.set_job_state(self.job_id, "stopped")
            raise
        finally:
            signal.signal(signal.SIGUSR1, old)
            signal.signal(signal.SIGTERM, old_term)
            for h in self.handles.values():
                h.kill()
            self.backend.close(self.reporter)

    def _on_usr1(self, _sig, _frame) -> None:
        self.log("SIGUSR1 received")
        self.signalled = True

    def _on_term(self, _sig, _frame) -> None:
        raise KeyboardInterrupt
