"""The model and optimizer of a layout, as the script's factories make them, and the state manifests of
any layout (what each rank holds, for a migration's plan and the launcher's placement)."""
from __future__ import annotations

from collections.abc import Callable, Mapping

from launcher.runtime.layout import Layout, parse_layout
from launcher.runtime.state import assemble, load_local, on_meta, stage_plan, to_local
from migrate.optim_state import record_creation, reset_to_created


class Builder:
    """The script's model and optimizer factories, applied to a layout."""

    def __init__(self, model: Callable, tp_plan: Mapping | None, optimizer: Callable,
                 manifest: Callable | None = None, fsdp_units: Callable | None = None) -> None:
        self.build_model, self.tp_plan, self.build_opt = model, dict(tp_plan or {}), optimizer
        self.fsdp_units = fsdp_units  # module -> its submodules FSDP2 gathers one at a time (join's fsdp_units)
        self._produce = manifest  # layout -> this rank's Manifest, for a model that shards itself
        self._mcache: dict[str, list] = {}

    def build(self, lay: Layout, local: Mapping | None = None):
        """Model and optimizer on layout `lay`, the optimizer's state created; with `local` (a migration's
        new state by FQN) holding that state. Where the model allows it (on_meta), a migration's model
        is built on the meta device and takes the received tensors themselves as its parameters and its
        optimizer's state (assemble): inside the pause, every rank otherwise allocated its whole state
        afresh, ran an optimizer step over it and copied every received tensor in (1.8 s of a 5.6 s
        pause, pp4tp2 -> pp4tp4 of the bench)."""
        import torch

        module = on_meta(self.build_model, lay, self.tp_plan) if local is not None else None
        if module is not None:
            return assemble(module, self.build_opt, local)
        module = self.build_model(lay)
        plan = stage_plan(module, self.tp_plan)
        if lay.tp > 1 and plan:
            from torch.distributed.tensor.parallel import parallelize_module

            module = parallelize_module(module, lay.tp_mesh, plan)
        if lay.fsdp > 1:  # FSDP2 over the TP shards (torchtitan's order): each unit the script names, then the rest
            from torch.distributed.fsdp import fully_shard

            for unit in self.fsdp_units(module) if self.fsdp_units is not None else ():
                if next(unit.parameters(), None) is not None:  # a block another pipeline stage owns is empty
                    fully_shard(unit, mesh=lay.fsdp_mesh)
            fully_shard(module, mesh=lay.fsdp_mesh)
        opt = self.build_opt(module.parameters())
        # create the optimizer's state now (a step with zero gradients), so it can be filled and moved
        saved = None if local is not None else {k: v.detach().clone() for k, v in module.state_dict().items()}
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        with record_creation(opt) as created:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if saved is None:  # a migration's state overwrites every value: nothing to restore
            load_local(module, opt, local)
            return module, opt
        with torch.no_grad():
            for k, v in module.state_dict().items():
                to_local(v).copy_(to_local(saved[k]))
        reset_to_created(opt, created)  # the state as torch creates it, before the zero step's update
        return module, opt

    def placeholder_optimizer(self):
        """The factory's optimizer over one placeholder parameter: the object the script holds from
        `join` on (its settings, a scheduler made on it), rebound to each layout's parameters (rebind)."""
        import torch

        return self.build_opt([torch.nn.Parameter(torch.zeros(1))])

    def class_manifests(self, layout: str) -> list:
        """The manifest of each class (migrate.layout.ParallelConfig.class_of) of `layout`: the stages built on the meta
        device, or the script's `manifest` producer (DP replicas hold their class's); no process needs
        to hold the layout."""
        from migrate.layout import ParallelConfig
        from migrate.manifest import layout_manifests, stage_manifests

        cfg = ParallelConfig.parse(layout)
        if self._produce is not None:
            if cfg.fsdp > 1:
                from migrate.layout import LayoutError

                raise LayoutError(f"{layout}: a model that shards itself (join's manifest=) does not run FSDP "
                                  "layouts; give a tp_plan instead, or leave fsdp/hsdp out of --layouts")
            return layout_manifests(cfg, lambda r: self._produce(parse_layout(layout, r, cfg.world_size)))
        return stage_manifests(cfg, lambda r: self.build_model(parse_layout(layout, r, cfg.world_size)),
                               self.tp_plan, self.build_opt)

    def manifests(self, layout: str) -> list:
        """Per-rank manifests of `layout` (no process needs to hold it)."""
        from migrate.layout import ParallelConfig

        if layout not in self._mcache:
            self._mcache[layout] = self.class_manifests(layout)
        cfg, classes = ParallelConfig.parse(layout), self._mcache[layout]
        return [classes[c] for c in cfg.class_list()]
