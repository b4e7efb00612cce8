"""Checkpoint-and-restart baselines: what users pay today to change a job's layout.

A direct migration is only worth its complexity if it beats the path people already take:
save a checkpoint, stop the job, start a new one on the new layout, reshard and load. This
module runs that path for real, with real processes, so `elastic bench` compares against
measured numbers rather than guesses:

1. SAVE: `prev.world_size` spawned workers build the reference `Trainer`, train
   `steps_before` steps (so Adam moments are non-zero) and write a checkpoint.
   * "torch_save": Megatron's default, one `torch.save` file per (pp, tp) rank (DP rank 0 only,
     DP replicas are identical), followed on the load side by an offline reshard that reads
     every file, reassembles full tensors along their TP dimension and cuts the new shards.
   * "dcp": `torch.distributed.checkpoint` with every tensor wrapped as a DTensor on the
     rank's (dp, tp) sub-mesh, so the checkpoint records global offsets, replicated tensors
     are written once, and a load on another layout reads only its own slices.
   The old processes then exit.
2. RESTART: `curr.world_size` new workers are spawned, join a new gloo world and build their
   `Trainer` (and, for DCP, the device mesh a DTensor job builds at start-up).
3. LOAD: each new rank reads its shard (torch_save: reshard offline first, in the launching
   process, then `torch.load` per rank; dcp: resharding `dcp.load`) and installs params, Adam
   moments and step in its Trainer.
4. VERIFY (untimed): every rank of both layouts hashes its state per unit of
   G = lcm(prev.tp, curr.tp) TP slices (migrate.checksum: xxh3 over dtype, shape and raw bytes, as the executor); the
   launching process checks that the new layout holds exactly the old layout's units,
   byte for byte. Hashes instead of a second full copy keep the reference from adding disk
   traffic that would disturb the timed phases.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from migrate.checkpoint import as_dtensors, layout_mesh
from migrate.checksum import unit_digest
from migrate.layout import ModelSpec, ParallelConfig, TensorSpec
from migrate.state import LocalState, initial_state, local_shape, shard_range
from migrate.workload import held_tensors, rank_workload
from migrate.train import Groups, Trainer, TrainConfig
from migrate.workload import slice_units

BaselineKind = Literal["torch_save", "dcp"]
KINDS: tuple[str, ...] = ("torch_save", "dcp")
# Kinds of state the Trainer exports and a checkpoint must carry.
STATE_KINDS: tuple[str, ...] = ("param", "exp_avg", "exp_avg_sq")

UnitKey = tuple[str, str, int]  # (state kind, tensor name, unit index; -1 for a replicated tensor)


@dataclass(frozen=True)
class BaselineResult:
    """Seconds per phase of one checkpoint-restart relayout, and whether it restored the state exactly.

    save_s: the slowest old rank, barrier to barrier, writing the checkpoint.
    restart_s: from the launcher starting the new processes to the last of them having
        joined the process group and built its model.
    load_s: torch_save: offline reshard + slowest rank's load and install; dcp: slowest rank's
        resharding load and install.
    total_s: save_s + restart_s + load_s (old processes' exit is not counted).
    bytes_written: every byte the path put on disk (for torch_save including the resharded files).
    """

    kind: str
    save_s: float
    restart_s: float
    load_s: float
    total_s: float
    bytes_written: int
    bit_exact: bool
    notes: str


# ---------------------------------------------------------------------------------------------
# Layout helpers shared by both paths and by verification


def _holding_ranks(model: ModelSpec, cfg: ParallelConfig) -> dict[str, list[tuple[int, TensorSpec]]]:
    """For each tensor name, the (rank, spec) pairs of `cfg` that hold a piece of it."""
    out: dict[str, list[tuple[int, TensorSpec]]] = {}
    for rank in range(cfg.world_size):
        w = rank_workload(cfg, rank, model.layers, cfg.tp)
        for spec in held_tensors(model, w):
            out.setdefault(spec.name, []).append((rank, spec))
    return out


def unit_hashes(model: ModelSpec, cfg: ParallelConfig, rank: int, state: LocalState,
                units: int) -> tuple[dict[UnitKey, int], list[str]]:
    """Hash every unit of state this rank should hold; problems (missing, extra, bad shape) as text.

    Units are G-ths of a tensor along its TP dim (whole tensor if replicated), so two layouts
    with different TP sizes can be compared unit by unit without assembling full tensors.
    Raw bytes are hashed, which is stricter than torch.equal (-0.0 vs 0.0, NaN payloads).
    """
    w = rank_workload(cfg, rank, model.layers, cfg.tp)
    specs = held_tensors(model, w)
    out: dict[UnitKey, int] = {}
    problems: list[str] = []
    for kind in STATE_KINDS:
        per = state.tensors.get(kind, {})
        extra = set(per) - {s.name for s in specs}
        if extra:
            problems.append(f"rank {rank} holds unexpected {kind} tensors {sorted(extra)[:3]}")
        for spec in specs:
            t = per.get(spec.name)
            if t is None:
                problems.append(f"rank {rank} lacks {kind} {spec.name}")
                continue
            if tuple(t.shape) != local_shape(spec, w):
                problems.append(f"rank {rank} {kind} {spec.name} has shape {tuple(t.shape)}, "
                                f"expected {local_shape(spec, w)}")
                continue
            if spec.tp_dim is None:
                out[(kind, spec.name, -1)] = unit_digest(t)
                continue
            unit_len = spec.shape[spec.tp_dim] // units
            off, length = shard_range(spec, w)
            for i in range(length // unit_len):
                piece = t.narrow(spec.tp_dim, i * unit_len, unit_len)
                out[(kind, spec.name, off // unit_len + i)] = unit_digest(piece)
    return out, problems


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fs_of(path: Path) -> str:
    """Filesystem type of `path` (longest mount-point prefix in /proc/mounts), for the notes."""
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt, typ = parts[1], parts[2]
                if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, fstype = mnt, typ
    except OSError:
        pass
    return fstype


# ---------------------------------------------------------------------------------------------
# Worker side


def _init_world(rank: int, cfg: ParallelConfig, port: int, world: str) -> None:
    """Join the gloo world `world` through the launcher's store (as torchrun's agent hosts one).

    Re-binding the same port for the second world failed now and then with EADDRINUSE while
    the first world's store socket lingered; one store in the launcher, with a key prefix per
    world, cannot collide with itself.
    """
    # One process per "device" on a machine with fewer cores: one intra-op thread each, or the
    # processes fight over the cores and every phase measures oversubscription instead.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    store = dist.PrefixStore(f"{world}/", dist.TCPStore("127.0.0.1", port, is_master=False))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.world_size)


def _old_worker(rank: int, kind: str, model: ModelSpec, cfg: ParallelConfig, tc: TrainConfig,
                steps_before: int, ckpt: str, port: int, units: int, q) -> None:
    """Train, then write the checkpoint inside a barrier-to-barrier timed region; hash outside it."""
    _init_world(rank, cfg, port, "old")
    world = list(range(cfg.world_size))
    trainer = Trainer(model, cfg, rank, initial_state(model, cfg, rank, tc.seed), world, Groups(cfg, world, rank), tc)
    for _ in range(steps_before):
        trainer.train_step()
    state = trainer.export_state()
    mesh = layout_mesh(cfg, world) if kind == "dcp" else None  # a DTensor job builds its mesh at start-up
    dist.barrier()
    t0 = time.monotonic()
    if kind == "torch_save":
        pp, dp, tp = cfg.coords(rank)
        if dp == 0:  # Megatron: DP replicas are identical, only DP rank 0 writes
            torch.save({"layout": str(cfg), "rank": rank, "step": state.step, "tensors": state.tensors},
                       os.path.join(ckpt, f"mp_rank_pp{pp:02d}_tp{tp:02d}.pt"))
    else:
        import torch.distributed.checkpoint as dcp

        sd = as_dtensors(model, state.tensors, mesh)
        sd["step"] = state.step
        dcp.save(sd, checkpoint_id=ckpt)
    dist.barrier()
    save_s = time.monotonic() - t0
    hashes, problems = unit_hashes(model, cfg, rank, state, units)
    q.put(("old", rank, {"save_s": save_s, "hashes": hashes, "problems": problems, "step": state.step}))
    dist.barrier()  # facts.md: DCP users abort at exit without a barrier before destroy
    dist.destroy_process_group()


def _new_worker(rank: int, kind: str, model: ModelSpec, cfg: ParallelConfig, tc: TrainConfig,
                src: str, port: int, units: int, corrupt: tuple[str, str] | None, q) -> None:
    """Restart (init + model build), then a barrier-to-barrier timed load and install."""
    t_enter = time.monotonic()
    _init_world(rank, cfg, port, "new")
    t_pg = time.monotonic()
    world = list(range(cfg.world_size))
    trainer = Trainer(model, cfg, rank, initial_state(model, cfg, rank, tc.seed), world, Groups(cfg, world, rank), tc)
    t_built = time.monotonic()
    mesh = layout_mesh(cfg, world) if kind == "dcp" else None
    t_ready = time.monotonic()
    dist.barrier()
    t0 = time.monotonic()
    params = dict(trainer.stage.named_parameters())
    if kind == "torch_save":
        ck = torch.load(os.path.join(src, f"rank{rank:05d}.pt"))
        step, tensors = ck["step"], ck["tensors"]
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tensors["param"][name])
        moments = {k: tensors[k] for k in ("exp_avg", "exp_avg_sq")}
    else:
        import torch.distributed.checkpoint as dcp

        moments = {k: {n: torch.empty_like(p.data) for n, p in params.items()} for k in ("exp_avg", "exp_avg_sq")}
        # params are loaded in place: the DTensors alias the Trainer's parameter storage
        sd = as_dtensors(model, {"param": {n: p.data for n, p in params.items()}, **moments}, mesh)
        sd["step"] = -1
        dcp.load(sd, checkpoint_id=src)
        step = int(sd["step"])
    for name, p in params.items():  # the same optimizer state the Trainer builds when resuming
        trainer.opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": moments["exp_avg"][name],
                                "exp_avg_sq": moments["exp_avg_sq"][name]}
    trainer.step_no = step
    dist.barrier()
    load_s = time.monotonic() - t0
    state = trainer.export_state()
    if corrupt is not None and corrupt[1] in state.tensors[corrupt[0]]:
        flat = state.tensors[corrupt[0]][corrupt[1]].view(torch.uint8).view(-1)
        flat[0] ^= 1  # one bit of one element, in the installed state itself
    hashes, problems = unit_hashes(model, cfg, rank, state, units)
    opt_steps = {float(st["step"]) for st in trainer.opt.state.values()}
    q.put(("new", rank, {"t_enter": t_enter, "t_pg": t_pg, "t_built": t_built, "t_ready": t_ready,
                         "load_s": load_s, "hashes": hashes, "problems": problems, "step": trainer.step_no,
                         "opt_steps": opt_steps}))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Launcher side


def _run_world(fn, nprocs: int, args: tuple, q) -> dict[int, dict]:
    """Start `nprocs` spawned workers, wait for all, return each rank's report."""
    pc = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    reports: dict[int, dict] = {}
    while not pc.join(timeout=0.05):
        while not q.empty():
            _, rank, rep = q.get()
            reports[rank] = rep
    while not q.empty():
        _, rank, rep = q.get()
        reports[rank] = rep
    if len(reports) != nprocs:
        raise RuntimeError(f"only {len(reports)} of {nprocs} workers reported")
    return reports


def reshard_torch_save(model: ModelSpec, prev: ParallelConfig, curr: ParallelConfig, src: Path, dst: Path) -> None:
    """Offline reshard of per-(pp, tp) files into one file per new rank.

    What Megatron's checkpoint converter does: read every old file, reassemble each full tensor
    along its TP dim (replicated tensors taken once, from TP rank 0), cut the new layout's
    shards. Files are memory-mapped so only the pages actually used are read.
    """
    old = {}
    for pp in range(prev.pp):
        for tp in range(prev.tp):
            old[(pp, tp)] = torch.load(src / f"mp_rank_pp{pp:02d}_tp{tp:02d}.pt", mmap=True)
    step = old[(0, 0)]["step"]
    holders = _holding_ranks(model, prev)
    new_ranks = [r for r in range(curr.world_size)]
    out: dict[int, dict[str, dict[str, torch.Tensor]]] = {r: {k: {} for k in STATE_KINDS} for r in new_ranks}
    new_w = {r: rank_workload(curr, r, model.layers, curr.tp) for r in new_ranks}
    new_holders = _holding_ranks(model, curr)
    for spec in model.tensors():
        # old pieces from DP rank 0, ordered by TP rank = by offset along the TP dim
        pieces = sorted(((prev.coords(r)[2], prev.coords(r)[0]) for r, _ in holders[spec.name]
                         if prev.coords(r)[1] == 0))
        for kind in STATE_KINDS:
            if spec.tp_dim is None:
                full = old[(pieces[0][1], pieces[0][0])]["tensors"][kind][spec.name]
            else:
                full = torch.cat([old[(pp, tp)]["tensors"][kind][spec.name] for tp, pp in pieces], dim=spec.tp_dim)
            for r, _ in new_holders[spec.name]:
                if spec.tp_dim is None:
                    part = full
                else:
                    off, length = shard_range(spec, new_w[r])
                    part = full.narrow(spec.tp_dim, off, length)
                out[r][kind][spec.name] = part.clone(memory_format=torch.contiguous_format)
    dst.mkdir(parents=True, exist_ok=True)
    for r in new_ranks:
        torch.save({"layout": str(curr), "rank": r, "step": step, "tensors": out[r]}, dst / f"rank{r:05d}.pt")


def _verify(old: dict[int, dict], new: dict[int, dict]) -> tuple[bool, list[str]]:
    """The new layout must hold exactly the old layout's units, each byte-identical."""
    problems: list[str] = []
    ref: dict[UnitKey, int] = {}
    for rank, rep in sorted(old.items()):
        problems += rep["problems"]
        for key, h in rep["hashes"].items():
            if key in ref and ref[key] != h:
                problems.append(f"old replicas of {key} differ (rank {rank})")
            ref.setdefault(key, h)
    steps = {rep["step"] for rep in old.values()}
    seen: set[UnitKey] = set()
    for rank, rep in sorted(new.items()):
        problems += rep["problems"]
        if {rep["step"]} != steps or rep["opt_steps"] != {float(s) for s in steps}:
            problems.append(f"new rank {rank} step {rep['step']}/{rep['opt_steps']}, old {steps}")
        for key, h in rep["hashes"].items():
            seen.add(key)
            if key not in ref:
                problems.append(f"new rank {rank} holds {key} the old layout did not")
            elif ref[key] != h:
                problems.append(f"new rank {rank} {key[0]} {key[1]} unit {key[2]} differs")
    missing = set(ref) - seen
    if missing:
        problems.append(f"{len(missing)} units of the old state are held by no new rank, e.g. {sorted(missing)[0]}")
    return not problems, problems


def run_baseline(kind: BaselineKind, model: ModelSpec, prev: ParallelConfig, curr: ParallelConfig, *,
                 tc: TrainConfig, steps_before: int = 1, workdir: Path, port: int,
                 corrupt: tuple[str, str] | None = None) -> BaselineResult:
    """Relayout `prev` -> `curr` by checkpoint and restart, with real processes, timed per phase.

    `port` is the TCP store this process hosts for both worlds' rendezvous. Files go under `workdir/<kind>/`, which is emptied first. `corrupt=(kind, name)`
    is fault injection for tests: after the load, the new ranks flip one bit of that tensor,
    which verification must catch.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    model.check_config(prev)
    model.check_config(curr)
    if tc.global_batch % (tc.micro_batch * prev.dp):
        raise ValueError(f"global batch {tc.global_batch} does not split over dp={prev.dp} x micro {tc.micro_batch}")
    workdir = Path(workdir).resolve()
    base = workdir / kind
    if base.exists():
        shutil.rmtree(base)
    ckpt = base / "ckpt"
    ckpt.mkdir(parents=True)
    units = slice_units(prev.tp, curr.tp)
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (kept alive)

    q = ctx.Queue()
    old = _run_world(_old_worker, prev.world_size, (kind, model, prev, tc, steps_before, str(ckpt), port, units, q), q)
    save_s = max(r["save_s"] for r in old.values())

    reshard_s = 0.0
    src = ckpt
    if kind == "torch_save":
        t0 = time.monotonic()
        src = base / "resharded"
        reshard_torch_save(model, prev, curr, ckpt, src)
        reshard_s = time.monotonic() - t0
    bytes_ckpt = _dir_bytes(ckpt)
    bytes_written = _dir_bytes(base)

    q = ctx.Queue()
    t_spawn = time.monotonic()
    new = _run_world(_new_worker, curr.world_size, (kind, model, curr, tc, str(src), port, units, corrupt, q), q)
    restart_s = max(r["t_ready"] for r in new.values()) - t_spawn
    rank_load_s = max(r["load_s"] for r in new.values())
    load_s = reshard_s + rank_load_s

    ok, problems = _verify(old, new)
    fs = _fs_of(workdir)
    # critical path: a collective waits for the last rank, so per-rank durations would count
    # the wait for a slow starter as init or build time
    last_enter = max(r["t_enter"] for r in new.values())
    last_pg = max(r["t_pg"] for r in new.values())
    spawn_s = last_enter - t_spawn
    init_s = last_pg - last_enter
    build_s = restart_s - spawn_s - init_s
    notes = [
        f"{prev} -> {curr}, {model.layers} layers hidden {model.hidden} vocab {model.vocab}, "
        f"state {model.state_bytes / 1e6:.1f} MB (param+exp_avg+exp_avg_sq), steps_before={steps_before}",
        f"workdir {workdir} on {fs} ({'tmpfs: RAM, no disk' if fs == 'tmpfs' else 'disk'}); "
        f"load reads what save just wrote, so from a warm page cache",
        f"restart = spawn {spawn_s:.2f} s + init_process_group {init_s:.2f} s + build {build_s:.2f} s (critical path: last rank to reach each point)",
    ]
    if kind == "torch_save":
        notes.append(f"load = offline reshard {reshard_s:.2f} s (one process) + rank load {rank_load_s:.2f} s; "
                     f"bytes: checkpoint {bytes_ckpt} + resharded {bytes_written - bytes_ckpt}; "
                     f"only DP rank 0 writes; torch.save does not fsync")
    else:
        notes.append("DTensor on the (dp,tp) sub-mesh, replicated tensors written once; "
                     "DCP FileSystemWriter defaults (fsync on); mesh build counted in restart")
    notes.append("bit-exact: every unit matches byte for byte" if ok else
                 f"NOT bit-exact ({len(problems)} problems): " + "; ".join(problems[:5]))
    return BaselineResult(kind=kind, save_s=save_s, restart_s=restart_s, load_s=load_s,
                          total_s=save_s + restart_s + load_s, bytes_written=bytes_written,
                          bit_exact=ok, notes="\n".join(notes))
