"""PUBLIC (through launcher.runtime): where one live-mode worker stands in a PP x DP x FSDP x TP layout.

A layout `ppPtpTdpD` has P pipeline stages, each replicated D times (DP), each replica cut T ways
(TP); `fsdpF` shards each replica's parameters, gradients and optimizer state F ways more (FSDP2's
`fully_shard`, applied by the runtime after the TP plan), `hsdpDxF` is D replicas of F shards (HSDP).
Ranks follow torchtitan's mesh order [pp, dp, fsdp, tp] (migrate.layout.ParallelConfig): TP
fastest, then FSDP, then DP, then PP, so rank = ((pp_rank * dp + dp_rank) * fsdp + fsdp_rank) * tp +
tp_rank, and the ranks of one stage are contiguous. The batch is split dp * fsdp ways
(`data_size`, `data_rank`): FSDP ranks train different data, like DP replicas.

The script builds ITS STAGE of the model for a layout (the `model(layout)` builder of
`runtime.join`). The recommended way, torchtitan's: build the whole model with the same seed on
every rank, then drop what other stages own while keeping the GLOBAL fully-qualified names
(`blocks.5.fc.weight` stays `blocks.5.fc.weight` on the stage that holds block 5), e.g. with
`keep_stage_blocks` (other stages' blocks become `nn.Identity()`) and `None` for an embedding or
head the stage does not own. Names that do not depend on the split make the state manifests of
different splits match, so a migration moves only what changes owner. The builder is also called
on the meta device for layouts no process holds yet (`layout.mesh` is None then): it must decide
from `layout.pp`, `layout.pp_rank` (and `tp`, `dp`) alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass
class Layout:
    """This process's place in the running layout: sizes `pp`, `tp`, `dp`, `fsdp`, its `rank` in
    `world_size`, and `mesh`, the (pp, dp, fsdp, tp) DeviceMesh (dims named "pp", "dp", "fsdp", "tp";
    None on the meta device)."""

    pp: int
    tp: int
    dp: int
    rank: int
    world_size: int
    mesh: object = None
    fsdp: int = 1

    @cached_property
    def config(self):
        """The layout's sizes as a migrate.layout.ParallelConfig: the one place its rank order is written."""
        from migrate.layout import ParallelConfig

        return ParallelConfig(self.pp, self.tp, self.dp, self.fsdp)

    @property
    def tp_rank(self) -> int:
        return self.config.coords(self.rank)[2]

    @property
    def fsdp_rank(self) -> int:
        return self.config.fsdp_rank(self.rank)

    @property
    def dp_rank(self) -> int:
        """This process's DP replica (FSDP ranks of one replica share it: see data_rank)."""
        return self.config.coords(self.rank)[1]

    @property
    def data_size(self) -> int:
        """How many ways the batch is split: dp * fsdp."""
        return self.dp * self.fsdp

    @property
    def data_rank(self) -> int:
        """Which part of the batch this rank trains on, of `data_size` (the same on every TP rank)."""
        return self.config.data_rank(self.rank)

    @property
    def pp_rank(self) -> int:
        """This process's pipeline stage (0 = the first)."""
        return self.config.coords(self.rank)[0]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous stage's process with this DP and TP rank (None on the first stage):
        where activations come from and gradients go to."""
        return None if self.is_first_stage else \
            self.config.rank(self.pp_rank - 1, self.dp_rank, self.tp_rank, self.fsdp_rank)

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next stage's process with this DP and TP rank (None on the last stage)."""
        return None if self.is_last_stage else \
            self.config.rank(self.pp_rank + 1, self.dp_rank, self.tp_rank, self.fsdp_rank)

    @property
    def tp_mesh(self):
        return self.mesh["tp"]

    @property
    def stage_mesh(self):
        """The (dp, fsdp, tp) mesh of this rank's stage (checkpoints place its pieces on it)."""
        return self.mesh["dp", "fsdp", "tp"]

    @property
    def dp_group(self):
        return self.mesh.get_group("dp")

    @property
    def fsdp_mesh(self):
        """The mesh FSDP2 shards over: ("fsdp",), or ("dp", "fsdp") for HSDP (replicate, shard)."""
        return self.mesh["dp", "fsdp"] if self.dp > 1 else self.mesh["fsdp"]

    @property
    def pp_group(self):
        """The process group of this pipeline (one process per stage, same DP and TP rank)."""
        return self.mesh.get_group("pp")

    def stage_blocks(self, n: int) -> range:
        """Block indices this stage owns out of `n` in a row: contiguous, sizes differing by at most one
        (n // pp each when pp divides n, the reference GPT's rule)."""
        return range(self.pp_rank * n // self.pp, (self.pp_rank + 1) * n // self.pp)

    @property
    def name(self) -> str:
        return str(self.config)


def parse_layout(text: str, rank: int, world: int) -> Layout:
    from migrate.layout import ParallelConfig

    cfg = ParallelConfig.parse(text)
    return Layout(cfg.pp, cfg.tp, cfg.dp, rank, world, fsdp=cfg.fsdp)


def device_mesh(lay: Layout):
    """The (pp, dp, fsdp, tp) CPU DeviceMesh of the current world (every rank calls it). Each process forms
    only the groups it is in, synchronised with their members alone (new_group's
    use_local_synchronization): init_device_mesh forms every group of every dimension on every process,
    each behind a barrier of the whole world, which inside a migration's pause cost 0.16 s of 32
    processes on 2 cores (pp4tp8dp1: 44 groups, of which a process is in 3). A dimension as large as
    the world is the world's own group; dimensions with the same members share one group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.arange(lay.world_size).view(lay.pp, lay.dp, lay.fsdp, lay.tp)
    made: dict[tuple[int, ...], object] = {}
    groups = []
    for dim, size in enumerate(grid.shape):
        rows = grid.movedim(dim, -1).reshape(-1, size).tolist()
        ranks = tuple(next(r for r in rows if lay.rank in r))
        if ranks not in made:
            made[ranks] = dist.group.WORLD if size == lay.world_size else \
                dist.new_group(list(ranks), use_local_synchronization=True)
        groups.append(made[ranks])
    return DeviceMesh.from_group(groups, "cpu", mesh=grid, mesh_dim_names=("pp", "dp", "fsdp", "tp"))


def keep_stage_blocks(blocks, layout: Layout) -> None:
    """Keep in the nn.ModuleList `blocks` only this stage's blocks (Layout.stage_blocks); the others
    become nn.Identity(), so the kept ones keep their global names (`blocks.<i>.…`)."""
    from torch import nn

    mine = layout.stage_blocks(len(blocks))
    for i in range(len(blocks)):
        if i not in mine:
            blocks[i] = nn.Identity()
