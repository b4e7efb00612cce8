"""PUBLIC: what a training script imports to run in LIVE mode under elastic-launch.

Live mode moves the training state directly between the running workers when the job is
resized; no step is lost or repeated. The script says how to build its model for a layout and
runs its own step; at every step boundary it hands control to the runtime:

    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from launcher import runtime

    job = runtime.join(
        model=lambda layout: MyModel(),                  # built with the same seed on every rank
        tp_plan={"up": ColwiseParallel(), "down": RowwiseParallel()},  # parallelize_module's plan
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        state={"data": loader},                          # anything with state_dict/load_state_dict
    )
    while job.next_step(until=100):                      # the step boundary: migrations happen here
        loss = job.model(batch(job.step, job.layout)).sum()
        job.optimizer.zero_grad(); loss.backward()
        job.reduce_gradients()                           # DP all-reduce (mean)
        job.optimizer.step()

`job.layout` says where this process stands: `tp`, `dp` (and their ranks), `rank`, `world_size`,
`mesh` (a (dp, tp) DeviceMesh), `tp_mesh`, `dp_group`. The state that moves is the torch-native
one: the model's `state_dict` (DTensor placements Shard(d)/Replicate from `tp_plan`), the
optimizer's per-parameter state, and every object in `state` (its `state_dict()`, e.g. a data
position, an LR scheduler, an RNG). The manifest of a layout no process holds yet comes from
building the model on the meta device (migrate.manifest.plan_manifest).

A program that never calls `runtime.join(...)` runs in RESTART mode (torchrun's contract; see the
README). One that calls it but never reaches `job.next_step()` is named by the launcher.
"""
from __future__ import annotations

import io
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from launcher import control as C

#: what the launcher names when a joined worker never reaches the step boundary
STEP_CALL = "job.next_step()"
JOIN_CALL = "launcher.runtime.join(...)"


@dataclass
class Layout:
    """This process's place in the running layout (pipeline parallelism: not in live mode yet)."""

    tp: int
    dp: int
    rank: int
    world_size: int
    mesh: object = None  # DeviceMesh (dp, tp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_mesh(self):
        return self.mesh["tp"]

    @property
    def dp_group(self):
        return self.mesh.get_group("dp")

    @property
    def name(self) -> str:
        return f"pp1tp{self.tp}dp{self.dp}"


def parse_layout(text: str, rank: int, world: int) -> Layout:
    from migrate.layout import ParallelConfig

    cfg = ParallelConfig.parse(text)
    if cfg.pp != 1:
        raise RuntimeError(f"layout {text}: pipeline parallelism is not supported in live mode yet; "
                           "give --layouts with pp1")
    return Layout(cfg.tp, cfg.dp, rank, world)


class Job:
    """One worker of a live-mode job (see the module docstring); made by `join`."""

    def __init__(self, ctl: C.Control, device: int, model: Callable, tp_plan: Mapping | None,
                 optimizer: Callable, state: Mapping[str, object]) -> None:
        self.ctl, self.device = ctl, device
        self._build_model, self.tp_plan, self._build_opt = model, dict(tp_plan or {}), optimizer
        self.extras = dict(state)
        self.model = self.optimizer = None
        self.layout: Layout | None = None
        self.step = 0
        self.epoch = int(os.environ.get(C.ENV_FIRST_EVENT, "0"))
        self.devices: list[int] = []
        self._at: int | None = None
        self.migrations = 0

    # -- the step boundary ------------------------------------------------------------------------
    def next_step(self, until: int | None = None) -> bool:
        """Call before every step: publishes progress, applies a migration or stop that is due here.
        True: run step `job.step + 1` now; False: the job is over for this worker (exit)."""
        while True:
            if self.model is not None:
                self.ctl.set_step(self.device, self.step)
            ev = self.ctl.event(self.epoch) if self.model is not None else self.ctl.wait_event(self.epoch)
            if ev is not None and self.model is not None and self._at is None and not ev.get("urgent"):
                self._at = self.ctl.agree_at(self.epoch, self.step)
            if ev is not None and (self.model is None or self._at is None or self.step >= self._at):
                self._at = None
                if not self._handle(ev):
                    self._leave()
                    return False
                continue
            if self.model is None:
                continue
            if until is not None and self.step >= until:
                self._leave()
                return False
            self.step += 1
            return True

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

    # -- events -----------------------------------------------------------------------------------
    def _handle(self, ev: dict) -> bool:
        kind = ev["kind"]
        self.epoch = ev["epoch"] + 1
        if kind == "stop":
            return False
        if kind == "start":
            if self.device not in ev["devices"]:
                return True  # standby until a migration brings this device in
            self._enter(ev["layout"], ev["devices"], f"w{ev['epoch']}", None)
            return True
        if kind == "reshard":
            return self._reshard(ev)
        if kind == "exit":
            return self.device not in ev["devices"]
        raise RuntimeError(f"event {kind!r} is not supported in live mode by launcher.runtime")

    def _enter(self, layout: str, devices: list[int], world: str, local: dict | None) -> None:
        """Join the layout's world, build model and optimizer there, fill them with `local` if given."""
        from torch.distributed.device_mesh import init_device_mesh

        rank = self.ctl.join_world(world, devices, self.device, 120.0)
        _forget_old_meshes()
        lay = parse_layout(layout, rank, len(devices))
        lay.mesh = init_device_mesh("cpu", (lay.dp, lay.tp), mesh_dim_names=("dp", "tp"))
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(len(devices)), "ELASTIC_LAYOUT": lay.name})
        self.model, self.optimizer = self._build(lay)
        self.layout, self.devices = lay, list(devices)
        if local is not None:
            _load_local(self.model, self.optimizer, local)

    def _build(self, lay: Layout):
        import torch

        module = self._build_model(lay)
        if lay.tp > 1 and self.tp_plan:
            from torch.distributed.tensor.parallel import parallelize_module

            module = parallelize_module(module, lay.tp_mesh, self.tp_plan)
        opt = self._build_opt(module.parameters())
        # create the optimizer's state now (a step with zero gradients), so it can be filled and moved
        saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for k, v in module.state_dict().items():
                _local(v).copy_(_local(saved[k]))
        for st in opt.state.values():
            for key, v in st.items():
                if hasattr(v, "zero_"):
                    _local(v).zero_()
        return module, opt

    def _manifests(self, layout: str) -> list:
        """Per-rank manifests of `layout`, built on the meta device (no process needs to hold it)."""
        from migrate.manifest import meta_module, plan_manifest

        lay = parse_layout(layout, 0, 0)
        kind = _optimizer_kind(self._build_opt)
        out, cache = [], {}
        for r in range(lay.tp * lay.dp):
            t = r % lay.tp
            if t not in cache:
                meta = meta_module(self._build_model, parse_layout(layout, r, lay.tp * lay.dp))
                cache[t] = plan_manifest(meta, self.tp_plan, lay.tp, t, kind)
            out.append(cache[t])
        return out

    def _reshard(self, ev: dict) -> bool:
        import torch.distributed as dist

        from migrate.reshard import execute, plan_transfers

        e, parts = ev["epoch"], ev["participants"]
        prev, curr = ev["prev"], ev["curr"]
        if self.device not in parts:
            return self.device not in ev.get("exit_ok", [])
        t0 = time.perf_counter()
        old_rank = prev["devices"].index(self.device) if self.device in prev["devices"] else None
        new_rank = curr["devices"].index(self.device) if self.device in curr["devices"] else None
        local = {}
        if old_rank is not None:
            local = _export_local(self.model, self.optimizer)
            self.ctl.store.set(f"ev/{e}/extra/{old_rank}", _dumps({k: v.state_dict() for k, v in self.extras.items()}))
            self.ctl.store.set(f"ev/{e}/step/{old_rank}", str(self.step))
        self.model = self.optimizer = None
        old_ms, new_ms = self._manifests(prev["layout"]), self._manifests(curr["layout"])
        same = {r: prev["devices"].index(d) for r, d in enumerate(curr["devices"]) if d in prev["devices"]}
        transfers = plan_transfers(old_ms, new_ms, same)
        self.ctl.join_world(f"m{e}", parts, self.device, 120.0)
        t1 = time.perf_counter()
        procs_old = [parts.index(d) for d in prev["devices"]]
        procs_new = [parts.index(d) for d in curr["devices"]]
        result = execute(transfers, old_rank, new_rank, local, old_ms[old_rank] if old_rank is not None else None,
                         new_ms[new_rank] if new_rank is not None else None, procs_old, procs_new)
        moved = sum((t.hi - t.lo) * new_ms[t.dst].by_fqn()[t.fqn].row_bytes if t.dim is not None
                    else new_ms[t.dst].by_fqn()[t.fqn].nbytes for t in transfers if same.get(t.dst) != t.src)
        t2 = time.perf_counter()
        if new_rank is None:
            dist.destroy_process_group()
            self.ctl.set_result(e, self.device, {"ok": True, "step": None, "bytes_moved": moved,
                                                 "phases": {"execute": t2 - t1}})
            return False
        src = same.get(new_rank, 0)
        extras = _loads(self.ctl.store.get(f"ev/{e}/extra/{src}"))
        self.step = int(self.ctl.store.get(f"ev/{e}/step/{src}").decode())
        for k, obj in self.extras.items():
            obj.load_state_dict(extras[k])
        self._enter(curr["layout"], curr["devices"], f"w{e}", result)
        self.migrations += 1
        self.ctl.set_result(e, self.device, {"ok": True, "step": self.step, "bytes_moved": moved, "phases": {
            "build_groups": t1 - t0, "execute": t2 - t1, "rebuild": time.perf_counter() - t2}})
        return True

    def _leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


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


def _export_local(model, opt) -> dict:
    """This rank's pieces by FQN (migrate.manifest naming), detached from the model."""
    out = {k: _local(v).detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for key, v in st.items():
            if hasattr(v, "shape"):
                out[f"optim.state.{names[id(p)]}.{key}"] = _local(v).detach().clone()
    return out


def _load_local(model, opt, local: Mapping) -> None:
    import torch

    with torch.no_grad():
        for k, v in model.state_dict().items():
            _local(v).copy_(local[k])
        names = {id(p): n for n, p in model.named_parameters()}
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


# -- joining --------------------------------------------------------------------------------------
def join(*, model: Callable, optimizer: Callable, tp_plan: Mapping | None = None,
         state: Mapping[str, object] | None = None) -> Job:
    """Join the elastic job as one live-mode worker; returns the Job whose `next_step()` drives training.

    model(layout) -> nn.Module: the whole model, created identically on every rank (seed it);
    tp_plan: parallelize_module's plan, applied by the runtime when the layout has tp > 1;
    optimizer(params) -> torch.optim.Optimizer; state: extra objects with state_dict/load_state_dict."""
    from launcher.worker import device_from_env

    if C.ENV_STORE not in os.environ:
        raise RuntimeError(f"{JOIN_CALL}: this program must be started by elastic-launch (${C.ENV_STORE} is unset)")
    device, _local_id, _gpn = device_from_env()
    ctl = C.Control.from_env()
    ctl.hello(device)
    job = Job(ctl, device, model, tp_plan, optimizer, state or {})
    spec = {"kind": "generic", "tp_plan": sorted(job.tp_plan)}
    agreed = ctl.offer_model(spec)
    if agreed != spec:
        print(f"runtime: this worker's model {spec} differs from the job's {agreed}", file=sys.stderr)
        raise SystemExit(2)
    ctl.set_ready(device, {"pid": os.getpid(), "host": socket.gethostname(), "api": "runtime"})
    return job
