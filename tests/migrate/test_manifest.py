"""State manifests: the byte workload they give the planner, checked against independent oracles
(the reference GPT's rectangle byte model; element masks counted by brute force), and the meta-device
manifest of a layout checked against the DTensor state of real processes holding it."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from torch import nn

from migrate.layout import LayoutError, ModelSpec, ParallelConfig
from migrate.manifest import (
    Manifest, ManifestError, ShardEntry, class_cost, gpt_manifest, layout_manifests, meta_module, module_manifest,
    plan_manifest,
)
from migrate.workload import ByteModel, class_workloads, slice_units


@pytest.mark.parametrize("prev,curr", [("pp2tp2", "pp2tp1"), ("pp4tp2", "pp2tp4"), ("pp1tp4", "pp4tp1"),
                                       ("pp2tp1dp2", "pp1tp2dp1")])
def test_gpt_manifests_give_the_rectangle_byte_model(prev: str, curr: str) -> None:
    model = ModelSpec(layers=4, hidden=128, heads=4, vocab=512, seq_len=16)
    a, b = ParallelConfig.parse(prev), ParallelConfig.parse(curr)
    units = slice_units(a.tp, b.tp)
    want = ByteModel.of_model(model, units).cost(class_workloads(b, 4, units), class_workloads(a, 4, units))
    got = class_cost(layout_manifests(b, lambda r: gpt_manifest(model, b, r)),
                     layout_manifests(a, lambda r: gpt_manifest(model, a, r)))
    np.testing.assert_array_equal(got, want)


def _mask(e: ShardEntry) -> np.ndarray:
    """Brute force: which elements of the global tensor the piece holds (np.array_split = Shard chunks)."""
    m = np.zeros(e.shape or (1,), dtype=bool)
    if e.dim is None:
        m[...] = True
        return m
    n = e.shape[e.dim]
    chunk = -(-n // e.count)
    idx = [slice(None)] * len(e.shape)
    idx[e.dim] = slice(min(e.index * chunk, n), min((e.index + 1) * chunk, n))
    m[tuple(idx)] = True
    return m


def test_overlaps_match_element_masks_for_uneven_and_crossed_shards() -> None:
    shape = (7, 5)
    pieces = [ShardEntry("w", shape, "float32")] + [
        ShardEntry("w", shape, "float32", d, i, c) for d in (0, 1) for c in (2, 3, 4) for i in range(c)]
    rows = [Manifest((p,)) for p in pieces]
    cost = class_cost(rows, rows)
    for (i, a), (j, b) in itertools.product(enumerate(pieces), repeat=2):
        need = _mask(a).sum() * 4
        both = (_mask(a) & _mask(b)).sum() * 4
        assert cost[i, j] == need - both, (a, b)


def test_bad_manifests_are_refused_in_one_line() -> None:
    with pytest.raises(ManifestError, match="more than once"):
        Manifest((ShardEntry("a", (2,), "float32"), ShardEntry("a", (2,), "float32")))
    with pytest.raises(ManifestError, match="shard dim 2"):
        ShardEntry("a", (2, 2), "float32", 2, 0, 2)
    with pytest.raises(ManifestError, match="shape/dtype"):
        class_cost([Manifest((ShardEntry("a", (4,), "float32"),))], [Manifest((ShardEntry("a", (8,), "float32"),))])


class Mixer(nn.Module):
    """Not the GPT: other names and shapes (a small MLP-Mixer-like block)."""

    def __init__(self, d: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


TP_PLAN = {"up": "ColwiseParallel", "down": "RowwiseParallel"}


def test_meta_manifest_of_a_tp_layout() -> None:
    m = meta_module(Mixer)
    assert next(m.parameters()).device.type == "meta"
    got = {e.fqn: (e.dim, e.index, e.count, e.local_shape) for e in plan_manifest(m, TP_PLAN, 2, 1).entries}
    assert got["up.weight"] == (0, 1, 2, (6, 8)) and got["up.bias"] == (0, 1, 2, (6,))
    assert got["down.weight"] == (1, 1, 2, (8, 6)) and got["down.bias"] == (None, 0, 1, (8,))
    assert got["norm.weight"] == (None, 0, 1, (8,))
    assert got["optim.state.down.weight.exp_avg"] == (1, 1, 2, (8, 6))
    assert got["optim.state.up.bias.step"] == (None, 0, 1, ())


#: optimizers whose state the meta manifest is checked against under TP: Adam's, RMSprop's three
#: parameter-shaped tensors, ASGD's scalar tensors (plain tensors beside the DTensor parameters)
OPTIMIZERS = {"Adam": {}, "RMSprop": {"momentum": 0.9, "centered": True}, "ASGD": {}}


def _optimizer(name: str):
    return lambda params: getattr(torch.optim, name)(params, **OPTIMIZERS[name])


def _real_manifest(name: str, rank: int, port: int, q) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(Mixer(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = _optimizer(name)(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    q.put((rank, module_manifest(model, opt).to_list()))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_meta_manifest_equals_the_dtensor_state_real_processes_hold(name: str) -> None:
    import functools

    from tests.migrate.spawned import run_spawned

    got = run_spawned(functools.partial(_real_manifest, name), 2)
    for r in range(2):
        real = {e.fqn: e for e in Manifest.from_list(got[r]).entries}
        meta = {e.fqn: e for e in plan_manifest(meta_module(Mixer), TP_PLAN, 2, r, _optimizer(name)).entries}
        assert real == meta


def test_state_not_shaped_like_its_tp_sharded_parameter_is_refused() -> None:
    """Adafactor factors a matrix's second moment into a row and a column: what DTensor would make of them is
    unknown (torch's Adafactor cannot step a DTensor matrix), so a TP layout is refused; tp 1 is fine."""
    adafactor = lambda params: torch.optim.Adafactor(params)  # noqa: E731
    with pytest.raises(ManifestError, match=r"optim.state.up.weight.col_var: shape \(1, 8\)"):
        plan_manifest(meta_module(Mixer), TP_PLAN, 2, 0, adafactor)
    got = plan_manifest(meta_module(Mixer), TP_PLAN, 1, 0, adafactor).by_fqn()
    assert (got["optim.state.up.weight.row_var"].shape, got["optim.state.up.weight.col_var"].shape) == ((12, 1), (1, 8))


class _Stack(nn.Module):
    """A pipeline-able model: in, 4 blocks, head; `_stage` cuts it to one stage under the global names."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(4))
        self.head = nn.Linear(8, 2)


def _stage(cfg: ParallelConfig, rank: int) -> _Stack:
    pp = cfg.coords(rank)[0]
    m = _Stack()
    for i in range(4):
        if i // (4 // cfg.pp) != pp:
            m.blocks[i] = nn.Identity()
    m.inp = m.inp if pp == 0 else None
    m.head = m.head if pp == cfg.pp - 1 else None
    return m


def test_stage_manifests_of_pp_layouts_hold_each_stage_once_and_move_only_what_changes_owner() -> None:
    from migrate.manifest import stage_manifests
    from migrate.reshard import plan_transfers

    plan = {f"blocks.{i}.1": "ColwiseParallel" for i in range(4)}
    whole = {k: v.numel() * 4 for k, v in _Stack().state_dict().items()}  # fp32 bytes by name
    for text in ("pp2tp2dp2", "pp4tp1dp1", "pp1tp2dp1"):
        cfg = ParallelConfig.parse(text)
        ms = stage_manifests(cfg, lambda r, cfg=cfg: _stage(cfg, r), plan, optimizer=None)  # per (pp, tp)
        assert len(ms) == cfg.pp * cfg.tp
        for c, m in enumerate(ms):
            assert all(e.dim is None or (e.index, e.count) == (c % cfg.tp, cfg.tp) for e in m.entries)
        stages = [{e.fqn for e in ms[p * cfg.tp].entries} for p in range(cfg.pp)]
        assert sorted(n for s in stages for n in s) == sorted(whole)  # every tensor on exactly one stage
        assert next(iter(_stage(cfg, 0).parameters())).device.type == "cpu"  # the builder itself is untouched
    # pp2 -> pp1 (dp1, tp1) on the first stage's process: the second stage's bytes move, nothing else
    old = stage_manifests(ParallelConfig(pp=2), lambda r: _stage(ParallelConfig(pp=2), r), None, optimizer=None)
    new = stage_manifests(ParallelConfig(pp=1), lambda r: _stage(ParallelConfig(pp=1), r), None, optimizer=None)
    moved = [t for t in plan_transfers(old, new, {0: 0}) if t.src != 0]
    assert moved and {t.src for t in moved} == {1}
    assert sum(whole[t.fqn] for t in moved) == sum(v for k, v in whole.items() if k.startswith(("blocks.2", "blocks.3", "head")))


def _real_fsdp_manifest(rank: int, port: int, q) -> None:
    """Rank `rank` of FSDP2 x TP (tp2fsdp2: mesh (fsdp, tp)) as torchtitan builds it: the TP plan, then
    fully_shard over the fsdp dimension; its manifest, and every piece it holds beside the whole tensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    torch.manual_seed(0)
    model = parallelize_module(Mixer(8, 10), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["fsdp"])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    pieces = {k: (v.to_local().numpy().copy(), v.full_tensor().numpy().copy())
              for k, v in model.state_dict().items() if isinstance(v, DTensor)}
    q.put((rank, (module_manifest(model, opt).to_list(), pieces)))
    dist.barrier()
    dist.destroy_process_group()


def test_meta_manifest_of_fsdp2_over_tp_is_what_fully_shard_holds() -> None:
    """tp2fsdp2 of a Mixer with an uneven FSDP cut (up's 10 rows: 5 per TP rank, 3 + 2 per FSDP rank): the
    meta-device manifest (plan_manifest with fsdp) names, for every parameter and AdamW moment, the very box
    real fully_shard'ed processes hold; the oracle for the box is the data: the local tensor equals that box
    of DTensor.full_tensor()."""
    import functools

    from tests.migrate.spawned import run_spawned

    got = run_spawned(_real_fsdp_manifest, 4)
    cfg = ParallelConfig.parse("tp2fsdp2")
    adamw = lambda params: torch.optim.AdamW(params)  # noqa: E731
    for r in range(4):
        entries, pieces = got[r]
        real = {e.fqn: e for e in Manifest.from_list(entries).entries}
        meta = {e.fqn: e for e in plan_manifest(meta_module(functools.partial(Mixer, 8, 10)), TP_PLAN, 2,
                                                cfg.coords(r)[2], adamw, 2, cfg.fsdp_rank(r)).entries}
        assert {k: (e.shape, e.dtype, e.box) for k, e in real.items()} == \
            {k: (e.shape, e.dtype, e.box) for k, e in meta.items()}
        assert meta["up.weight"].local_shape == ((3, 8) if cfg.fsdp_rank(r) == 0 else (2, 8))
        assert meta["down.weight"].local_shape == (4, 5)  # rows by FSDP, columns by TP
        for k, (local, full) in pieces.items():
            box = tuple(slice(lo, hi) for lo, hi in meta[k].box)
            np.testing.assert_array_equal(local, full[box], err_msg=f"rank {r} {k}")


def test_layout_grammar_names_fsdp_and_hsdp() -> None:
    assert ParallelConfig.parse("pp2tp2fsdp4") == ParallelConfig(pp=2, tp=2, fsdp=4)
    assert ParallelConfig.parse("tp2hsdp2x2") == ParallelConfig(tp=2, dp=2, fsdp=2)
    cfg = ParallelConfig.parse("tp2hsdp2x2")
    assert str(cfg) == "pp1tp2dp2fsdp2" and ParallelConfig.parse(str(cfg)) == cfg and cfg.world_size == 8
    # torchtitan's mesh order [pp, dp_replicate, dp_shard, tp]: a class (pp, fsdp, tp) and its DP replicas
    assert cfg.class_list() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [cfg.class_rank(c, 1) for c in range(4)] == [4, 5, 6, 7]
    for bad in ("hsdp2", "fsdp2x2", "dp2hsdp2x2", "tp2fs"):
        with pytest.raises(LayoutError):
            ParallelConfig.parse(bad)
