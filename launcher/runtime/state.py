"""A worker's training state, torch-native, in and out of its model and optimizer: by FQN (migrate.manifest
naming) for a migration or a checkpoint to move, and put back without copies where torch allows it. Pure
functions of the objects given; the Job (launcher.runtime.job) decides when."""
from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping


def on_meta(build, lay, tp_plan: Mapping):
    """`build(lay)` on the meta device, for a migration to fill with the state it received (assemble),
    or None where that is not safe: a TP plan to apply or FSDP (DTensor), another backend than gloo, a tensor
    the state dict does not carry (a plain tensor attribute, a non-persistent buffer: no load fills
    it), or a tensor under two names (tied weights: assigning each name its own tensor unties them)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() != "gloo" or lay.fsdp > 1:
        return None
    with torch.device("meta"):
        module = build(lay)
    if lay.tp > 1 and stage_plan(module, tp_plan):
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


def assemble(module, build_opt, local: Mapping):
    """`module` (built on the meta device, on_meta) and its optimizer holding the tensors of `local`
    themselves, no copy: the parameters and buffers are assigned (load_state_dict assign=True), the
    optimizer's state is loaded from the received `optim.state.<param>.<key>` tensors (torch keeps a
    tensor of the right dtype and device as it is). The received tensors were allocated and written
    before the pause (migrate.reshard.allocate_targets), so training goes on in memory already mapped."""
    module.load_state_dict({k: local[k] for k in module.state_dict()}, assign=True)
    opt = build_opt(module.parameters())
    names = param_names(module)
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


def stage_plan(module, tp_plan: Mapping) -> dict:
    """The entries of `tp_plan` that name a module this stage holds (a pipeline stage lacks the others;
    parallelize_module would warn about every one of them)."""
    from fnmatch import fnmatch

    names = [n for n, _ in module.named_modules()]
    return {k: v for k, v in tp_plan.items() if any(fnmatch(n, k) for n in names)}


def to_local(t):
    """The tensor this rank holds of `t` (its shard of a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def state_views(model, opt) -> dict:
    """This rank's pieces by FQN (migrate.manifest naming): the model's and optimizer's own local tensors."""
    out = {k: to_local(v) for k, v in model.state_dict().items()}
    names = param_names(model)
    for p, st in opt.state.items():
        for key, v in st.items():
            if hasattr(v, "shape"):
                out[f"optim.state.{names[id(p)]}.{key}"] = to_local(v)
    return out


def param_names(model) -> dict[int, str]:
    """id(parameter) -> its name: how optimizer state (keyed by parameter) gets its FQN."""
    return {id(p): n for n, p in model.named_parameters()}


def export_local(model, opt) -> dict:
    """This rank's pieces by FQN, detached from the model: views of its tensors, no copy (the model and
    optimizer are dropped right after, so nothing changes them; --release-early frees them one by one)."""
    return {k: v.detach() for k, v in state_views(model, opt).items()}


def load_local(model, opt, local: Mapping) -> None:
    import torch

    with torch.no_grad():
        for k, v in model.state_dict().items():
            to_local(v).copy_(local[k])
        names = param_names(model)
        for p, st in opt.state.items():
            for key, v in st.items():
                if hasattr(v, "shape"):
                    to_local(v).copy_(local[f"optim.state.{names[id(p)]}.{key}"])


def dumps(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)




# -- the script's optimizer object across layouts ----------------------------------------------------
def rebind(opt, fresh) -> None:
    """Make `opt` (the optimizer object the script and its scheduler hold) train `fresh`'s parameters
    with `fresh`'s state, keeping its own settings (lr, betas, weight_decay, any key a scheduler or the
    script changed): `fresh` was made by the factory for this layout, so only its parameters, its state
    and keys `opt` lacks are taken. The group dicts stay `opt`'s own, as a scheduler may hold them."""
    if len(opt.param_groups) != len(fresh.param_groups):
        raise RuntimeError(f"the optimizer factory made {len(fresh.param_groups)} parameter groups for this layout "
                           f"and {len(opt.param_groups)} before: live mode needs the same groups on every layout")
    for group, new in zip(opt.param_groups, fresh.param_groups):
        for key, value in new.items():
            if key != "params":
                group.setdefault(key, value)
        group["params"] = new["params"]
    opt.state = fresh.state


def unbind(opt) -> None:
    """Let `opt` hold no parameter and no state (its settings stay): the layout it trained is left."""
    from collections import defaultdict

    for group in opt.param_groups:
        group["params"] = []
    opt.state = defaultdict(dict)


class OptimizerSettings:
    """The optimizer's per-group settings as a registered object: they move with the state (a migration,
    a checkpoint, a step taken back) so that a schedule goes on from where it was, on every layout."""

    def __init__(self, opt) -> None:
        self.opt = opt

    def state_dict(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    def fingerprints(self) -> tuple[int, int]:
        """(every group's lr, every group's other scalar settings), each a 62-bit digest: what the step's
        vote compares across the training world (launcher.runtime.vote), a few microseconds a step. A value
        that is no scalar (a callable, say) is left out: its repr may differ between equal processes."""
        lrs, rest = [], []
        for g in self.opt.param_groups:
            lrs.append(_scalar(g.get("lr")))
            rest.append(sorted((k, _scalar(v)) for k, v in g.items() if k not in ("params", "lr")
                               and _scalar(v) is not _OTHER))
        return _digest(lrs), _digest(rest)

    def load_state_dict(self, groups: list[dict]) -> None:
        if len(groups) != len(self.opt.param_groups):
            raise RuntimeError(f"{len(groups)} optimizer parameter groups received, this optimizer has "
                               f"{len(self.opt.param_groups)}")
        for group, saved in zip(self.opt.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})


_OTHER = object()  # a setting that is no scalar


def _scalar(v):
    """A setting as plain Python numbers (a one-element tensor as its value), _OTHER when it is none."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        items = [_scalar(x) for x in v]
        return _OTHER if any(x is _OTHER for x in items) else tuple(items)
    if hasattr(v, "numel") and v.numel() == 1:
        return v.item()
    return _OTHER


def _digest(values) -> int:
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(), "big") >> 2
