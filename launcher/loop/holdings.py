"""What the job holds: its nodes and their devices (the topology), which layout a device count gets,
and the nodes it gives back. Shared by both modes, so a restart and a live move see the same nodes."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from launcher.backends import NodeBackend
from launcher.loop.recorder import Recorder
from launcher.options import Options
from launcher.loop import live_plan
from launcher.policy.layouts import idle_note, tp_fit
from launcher.policy.survival import auto_checkpoint_every, survival
from migrate.layout import LayoutError
from migrate.topology import Device, Topology


class Holdings:
    """The allocation as the launcher sees it: nodes in order (the batch node first), their devices."""

    def __init__(self, opts: Options, backend: NodeBackend, recorder: Recorder) -> None:
        self.opts, self.backend, self.recorder = opts, backend, recorder
        self.gpn = opts.gpus_per_node
        self.alloc = backend.allocation()
        sizes = [backend.gpus_on(n) for n in self.alloc]
        self.topology = Topology.of_nodes(sizes, names=self.alloc, pinned=(backend.batch_node,))
        self.tp_fit = tp_fit(sizes)  # uneven nodes: TP groups that fit every node (gpn when all alike)
        if opts.checkpoint_auto and len(set(sizes)) > 1:  # uneven nodes: the allocation's sizes decide
            opts.checkpoint_every = auto_checkpoint_every(opts.min_nodes, opts.max_nodes, sizes, opts.layouts,
                                                          opts.model, opts.placement)
        self.index = {n: i for i, n in enumerate(self.alloc)}
        self.model = None  # the job's ModelSpec once known (the reference worker), else None

    # -- nodes and devices ----------------------------------------------------------------------------
    def node_devices(self, node: str) -> list[int]:
        return self.topology.node_devices(node)

    def devices_on(self, nodes: Sequence[str]) -> int:
        """How many devices `nodes` have (nodes may differ)."""
        return sum(len(self.topology.node_devices(n)) for n in nodes)

    def node_of(self, device: int) -> str:
        return self.topology.devices[device].node

    def nodes_of(self) -> dict[int, str]:
        return {d.id: d.node for d in self.topology.devices}

    def in_order(self, nodes) -> list[str]:
        """`nodes` in the allocation's order."""
        return [n for n in self.alloc if n in set(nodes)]

    @property
    def gone(self) -> set[str]:
        """Nodes given back that the backend never returns (Slurm's released nodes)."""
        db, job_id = self.recorder.db, self.recorder.job_id
        if db is None or job_id is None or self.backend.released_nodes_return:
            return set()
        return {n.name for n in db.list_nodes(job_id) if n.state in ("released", "failed")}

    def choose(self, devices: int):
        """The layout this job runs on `devices` devices (launcher.loop.live_plan.choose)."""
        return live_plan.choose(devices, self.tp_fit, self.opts.layouts, self.model)

    def idle_note(self, devices: int, layout) -> str | None:
        """Why `layout` leaves some of `devices` idle (launcher.policy.layouts.idle_note), else None."""
        return idle_note(devices, self.tp_fit, self.opts.layouts, self.model, layout)

    def keep_order(self, active: Sequence[str], running: Sequence[int]) -> list[str]:
        """Active nodes, the pinned batch node first, then in the backend's order (NodeBackend.keep_rank:
        e.g. a job's own nodes before a companion job's), then those running most ranks."""
        used: dict[str, int] = {}
        for d in running:
            used[self.node_of(d)] = used.get(self.node_of(d), 0) + 1
        return sorted(active, key=lambda n: (n != self.backend.batch_node, self.backend.keep_rank(n),
                                             -used.get(n, 0), self.index[n]))

    def survival(self, current):
        """What the rank map `current` survives (launcher.policy.survival), on the allocation's terms: a Slurm
        job without --no-kill ends when any node fails, whatever its replicas (NodeBackend.node_loss_ends_job)."""
        said, ends = survival(current.layout, current.devices, self.nodes_of()), self.backend.node_loss_ends_job
        # the batch node's loss: survived where a successor is queued to resume the job from its safety
        # checkpoint (launcher.backends.slurm.successor; guide: docs/guides/failures.md)
        return dataclasses.replace(said, batch=self.backend.successor is not None,
                                   **({"node": False, "node_note": ends} if ends else {}))

    def layout_choices(self) -> list[tuple[int, int, object]]:
        """(nodes, devices, the layout this job runs there) for every node count of --nnodes that has one."""
        out = []
        for n in range(self.opts.min_nodes, self.opts.max_nodes + 1):
            devices = self.devices_on(self.alloc[:n])
            try:
                out.append((n, devices, self.choose(devices)))
            except LayoutError:
                continue
        return out

    def layouts_said(self) -> str:
        """The layouts this job will use, for the log: "1 node: pp1tp2dp1, 2 nodes: pp1tp2dp2"."""
        return ", ".join(f"{n} node{'s' if n != 1 else ''}: {layout}" for n, _d, layout in self.layout_choices())

    def launch_spec(self, current) -> dict:
        """What the dashboard's dry run of a preempt needs without importing the launcher: the model (None for
        a script's own model: no dry run), the node range, and the layout this job's policy picks for every node
        count in it; and what the running layout survives, which `elastic jobs` and the job page show."""
        layouts = {str(devices): str(layout) for _n, devices, layout in self.layout_choices()}
        return {"model": None if self.model is None else self.model.flags(), "min_nodes": self.opts.min_nodes,
                "max_nodes": self.opts.max_nodes, "gpus_per_node": self.gpn, "layouts": layouts,
                "placement": self.opts.placement,
                "checkpoint_every": self.opts.checkpoint_every, "survives": self.survival(current).as_dict()}

    # -- what the database records of them ----------------------------------------------------------
    def entries(self, rank_map) -> list[dict]:
        """The rank map as database rows. `dp` is the rank's data-parallel rank: its replica times the FSDP
        shards plus its shard (dp_rank * fsdp + fsdp_rank), so that (pp, dp) names one TP group on every layout."""
        out = []
        cfg = rank_map.layout
        for r, d in enumerate(rank_map.devices):
            pp, _replica, tp = cfg.coords(r)
            dp = cfg.data_rank(r)
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

    # -- nodes that come and go -----------------------------------------------------------------------
    def add(self, nodes: Sequence[str]) -> None:
        """Nodes the backend acquired join the topology (a released name may come back: held again)."""
        new = [x for x in nodes if x not in self.index]
        if new:
            base = len(self.topology.devices)
            sizes = [self.backend.gpus_on(x) for x in new]
            devices = tuple(Device(base + sum(sizes[:i]) + g, x, g) for i, x in enumerate(new) for g in range(sizes[i]))
            self.topology = Topology(self.topology.devices + devices, self.topology.pinned)
            for x in new:
                self.index[x] = len(self.alloc)
                self.alloc.append(x)
        for x in nodes:
            self.recorder.node_state(x, "idle", **self.node_shape(x))

    def release(self, leaving: list[str], migration_id: int) -> tuple[str | None, list[str]]:
        """Give the departed nodes back after a committed move (NodeBackend.release): (error, notes).

        One place for every kind of move (live, restart), so each records the same node states: a node
        Slurm would not let go stays allocated, idle, and the backend's notes (which component gave what
        back, the fallback where Slurm refused) go into the audit log and the migration's history.
        """
        if not leaving:
            return None, []
        keep = [n for n in self.alloc if n not in leaving and n not in self.gone]
        try:
            notes = self.backend.release(keep)
        except Exception as exc:  # SlurmError: the job keeps running, the nodes stay allocated
            for n in leaving:
                self.recorder.node_state(n, "idle")
            return f"node release failed (nodes stay allocated, idle): {exc}", []
        for n in leaving:
            self.recorder.node_state(n, "idle" if self.backend.holds(n) else "released")
        for note in notes:
            self.recorder.audit("release", note)
        self.recorder.notes(migration_id, notes)
        return None, notes
