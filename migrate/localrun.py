"""Run one layout change with real processes on this machine: train, migrate, train on.

One process per device (device id = rank in the process world), gloo over loopback. Used by
`elastic bench`, the tests and the demo's measurements; the launcher runs the same executor
inside long-lived workers.
"""
from __future__ import annotations

import io
import math
import os
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from migrate.executor import MigrationError, execute, prepare_targets
from migrate.layout import ModelSpec, ParallelConfig
from migrate.plan import plan
from migrate.state import LocalState, initial_state
from migrate.topology import Topology
from migrate.train import Groups, TrainConfig, Trainer, warm_up


@dataclass(frozen=True)
class Scenario:
    model: ModelSpec
    prev: ParallelConfig
    curr: ParallelConfig
    tc: TrainConfig = TrainConfig()
    steps_before: int = 2
    steps_after: int = 2
    gpus_per_node: int = 8
    failed: tuple[int, ...] = ()
    kill_device: int | None = None  # fault injection: this device dies in the execute phase
    kill_after_rounds: int = 1
    collect_state: bool = False
    chunk_bytes: int | None = None  # None: the executor's automatic round size
    timeout_s: float = 60.0
    release_early: bool = False  # trade the old layout's safety for a lower peak memory

    @property
    def world(self) -> int:
        return max(self.prev.world_size, self.curr.world_size) + len(self.failed)

    def topology(self) -> Topology:
        return Topology.grid(math.ceil(self.world / self.gpus_per_node), self.gpus_per_node)


@dataclass
class DeviceReport:
    device: int
    losses_before: list[float | None]
    losses_after: list[float | None]
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    peak_bytes: int = 0
    steady_bytes: int = 0
    bytes_received: int = 0
    targets_prepared: int = 0  # new tensors allocated ahead of the migration
    targets_unused: int = 0  # ... of which the migration did not fill (should be none)
    state_before: bytes | None = None
    state_after: bytes | None = None  # new state, or the old one after a failed migration


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the one helper for it: launcher, bench, tests)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _dump(state: LocalState | None) -> bytes | None:
    if state is None:
        return None
    buf = io.BytesIO()
    torch.save({"tensors": state.tensors, "step": state.step}, buf)
    return buf.getvalue()


def load_state(blob: bytes) -> LocalState:
    d = torch.load(io.BytesIO(blob))
    return LocalState(d["tensors"], d["step"])


def _worker(device: int, sc: Scenario, port: int, queue) -> None:
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=device, world_size=sc.world,
                            timeout=timedelta(seconds=sc.timeout_s))
    report = DeviceReport(device, [], [])
    old_rank = device if device < sc.prev.world_size else None
    trainer = None
    old_world = list(range(sc.prev.world_size))
    groups = Groups(sc.prev, old_world, old_rank)
    if old_rank is not None:
        trainer = Trainer(sc.model, sc.prev, old_rank, initial_state(sc.model, sc.prev, old_rank, sc.tc.seed),
                          old_world, groups, sc.tc)
        report.losses_before = [trainer.train_step() for _ in range(sc.steps_before)]
    else:
        warm_up()
    survivors = [d for d in range(sc.world) if d not in sc.failed]
    mig_group = dist.new_group(survivors)
    if device in sc.failed:  # this device "fails": it leaves without taking part
        queue.put(report)
        return
    state = trainer.export_state() if trainer else None
    if sc.collect_state:
        report.state_before = _dump(state)
    # what a worker does when it learns of the migration, while it still trains: allocate the new tensors
    targets = prepare_targets(plan(sc.model, sc.prev, sc.curr, sc.topology(), frozenset(sc.failed)), device,
                              sc.release_early)
    report.targets_prepared = sum(len(per) for per in (targets or {}).values())
    dist.barrier(group=mig_group)
    t0 = time.perf_counter()
    p = plan(sc.model, sc.prev, sc.curr, sc.topology(), frozenset(sc.failed))
    t_plan = time.perf_counter() - t0
    hook = None
    if sc.kill_device == device:
        def hook(round_no: int) -> None:
            if round_no >= sc.kill_after_rounds:
                os._exit(17)
    if sc.release_early:
        trainer = None  # the executor must hold the only references for old tensors to be freed
    try:
        result = execute(p, device, state, chunk_bytes=sc.chunk_bytes, group=mig_group, on_round=hook,
                         release_early=sc.release_early, targets=targets)
    except MigrationError as exc:
        report.error = str(exc)
        report.state_after = _dump(state) if sc.collect_state else None
        queue.put(report)
        queue.close()
        queue.join_thread()  # flush the report before leaving
        os._exit(0)  # the process group is broken by the dead peer; nothing else to tear down
    report.phases = {"plan": t_plan, **result.phases}
    report.peak_bytes, report.steady_bytes, report.bytes_received = result.peak_bytes, result.steady_bytes, result.bytes_received
    report.targets_unused = result.targets_unused
    t1 = time.perf_counter()
    new_rank = p.curr.rank_of().get(device)
    new_groups = Groups(sc.curr, list(p.curr.devices), new_rank)
    report.phases["build_groups"] = time.perf_counter() - t1
    if new_rank is not None:
        t2 = time.perf_counter()
        trainer = Trainer(sc.model, sc.curr, new_rank, result.state, list(p.curr.devices), new_groups, sc.tc)
        report.phases["rebuild"] = time.perf_counter() - t2
        if sc.collect_state:
            report.state_after = _dump(trainer.export_state())
        report.losses_after = [trainer.train_step() for _ in range(sc.steps_after)]
    else:
        report.phases["rebuild"] = 0.0
    queue.put(report)
    dist.barrier(group=mig_group)
    dist.destroy_process_group()


def run_scenario(sc: Scenario, timeout_s: float = 600.0, ctx=None) -> list[DeviceReport]:
    """Spawn one process per device, run the scenario, return every device's report (by device). `ctx`: the
    multiprocessing context to start them with (default spawn; the tests pass a forkserver with torch preloaded)."""
    ctx = ctx or mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(d, sc, port, queue), daemon=True) for d in range(sc.world)]
    for p in procs:
        p.start()
    reports: dict[int, DeviceReport] = {}
    expected = sc.world - (1 if sc.kill_device is not None else 0)
    deadline = time.monotonic() + timeout_s
    while len(reports) < expected:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            r = queue.get(timeout=min(left, 5.0))
        except Exception:
            crashed = [d for d, p in enumerate(procs) if p.exitcode not in (None, 0) and d != sc.kill_device]
            if crashed or all(not p.is_alive() for p in procs):
                break
            continue
        reports[r.device] = r
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if len(reports) < expected:
        missing = sorted(set(range(sc.world)) - set(reports))
        raise RuntimeError(f"devices {missing} reported nothing (exit codes "
                           f"{[procs[d].exitcode for d in missing]})")
    return [reports[d] for d in sorted(reports)]
