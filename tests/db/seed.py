"""Test data builders shared by tests/db and tests/dashboard (all writes go through Store)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from db import Store
from db.records import RankEntry

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)


class FakeClock:
    """A settable clock so timings and the SLA are exact in tests."""

    def __init__(self, start: datetime = T0) -> None:
        self.t = start

    def __call__(self) -> datetime:
        return self.t

    def advance(self, seconds: float) -> datetime:
        self.t += timedelta(seconds=seconds)
        return self.t


def layout_entries(pp: int, tp: int, dp: int, nodes: list[str], gpus_per_node: int,
                   first_gpu: int = 0) -> list[RankEntry]:
    """Ranks ordered tp fastest, then dp, then pp, packed onto nodes in order."""
    out = []
    for rank in range(pp * tp * dp):
        p, rest = divmod(rank, dp * tp)
        d, t = divmod(rest, tp)
        slot = rank + first_gpu
        out.append(RankEntry(rank, nodes[slot // gpus_per_node], slot % gpus_per_node, p, d, t))
    return out


def seed_demo(store: Store, clock: FakeClock | None = None) -> dict[str, int]:
    """Two jobs; 'llama' shrank from pp2tp2dp2 (8 GPUs on n1, n2) to pp2tp2dp1 (4 on n1) via one
    migration at t=100..110 s, then 'bert' took two GPUs of n2. Ends at t=200 s."""
    tick = clock.advance if clock else (lambda s: None)
    llama = store.create_job("llama", "pp2tp2dp2", 4, 8, slurm_job_id="1234", pinned_node="n0",
                             sla_tier="premium", nodes=["n1", "n2"])
    store.record_rank_map(llama, 0, "pp2tp2dp2", layout_entries(2, 2, 2, ["n1", "n2"], 4))
    tick(100)
    mid = store.start_migration(llama, "pp2tp2dp2", "pp2tp2dp1", "resize",
                                {"pairs": 4, "instructions": {"send": 12, "recv": 12}},
                                store.fragmentation(llama))
    tick(10)
    store.record_rank_map(llama, 1, "pp2tp2dp1", layout_entries(2, 2, 1, ["n1"], 4))
    store.finish_migration(mid, "succeeded", 1_000_000, 8_000_000, True,
                           {"plan": 0.5, "build_groups": 1.5, "execute": 6.0, "rebuild": 2.0},
                           fragmentation_after=store.fragmentation(llama))
    store.set_pause(mid, 10.25)  # training stood still from before the plan until the first new step
    bert = store.create_job("bert", "pp1tp2dp1", 4, 2, nodes=["n2"])  # takes half of the freed node
    store.record_rank_map(bert, 0, "pp1tp2dp1", layout_entries(1, 2, 1, ["n2"], 4, first_gpu=2))
    tick(90)
    return {"llama": llama, "bert": bert, "migration": mid}


def spread_llama(store: Store, llama: int = 1) -> None:
    """Give seed_demo's llama two nodes again (n1, n3: epoch 2), so a preempt can leave it one."""
    store.record_rank_map(llama, 2, "pp2tp2dp2", layout_entries(2, 2, 2, ["n1", "n3"], 4))


#: Uneven nodes of a heterogeneous job: (name, GPUs, het-job component), the 4,4,2,2 testbed shape.
HET_NODES = (("a1", 4, 0), ("a2", 4, 0), ("b1", 2, 1), ("b2", 2, 1))


def uneven_entries(pp: int, tp: int, dp: int, nodes=HET_NODES) -> list[RankEntry]:
    """Ranks ordered tp fastest, then dp, then pp, packed onto `nodes` ((name, gpus, component)) in order."""
    slots = [(name, gpu, comp) for name, gpus, comp in nodes for gpu in range(gpus)]
    out = []
    for rank in range(pp * tp * dp):
        p, rest = divmod(rank, dp * tp)
        d, t = divmod(rest, tp)
        name, gpu, comp = slots[rank]
        out.append(RankEntry(rank, name, gpu, p, d, t, comp))
    return out


def seed_hetjob(store: Store, nodes=HET_NODES, layout: tuple[int, int, int] = (2, 2, 3)) -> int:
    """A running heterogeneous job on uneven nodes (default: 2 x 4-GPU nodes in component 0, 2 x 2-GPU
    in component 1) with pp2tp2dp3 packed on them, recorded through the Store like the launcher does."""
    pp, tp, dp = layout
    job = store.create_job("het", f"pp{pp}tp{tp}dp{dp}", max(g for _, g, _ in nodes), sum(g for _, g, _ in nodes),
                           pinned_node=nodes[0][0], nodes=[n for n, _, _ in nodes],
                           node_gpus={n: g for n, g, _ in nodes}, components={n: c for n, _, c in nodes})
    store.record_rank_map(job, 0, f"pp{pp}tp{tp}dp{dp}", uneven_entries(pp, tp, dp, nodes))
    return job
