"""The planner's placement is the optimum under the node rule: checked against brute force.

The oracle shares no code with the planner. It writes down the model's tensors itself
(Megatron GPT: which tensors exist, their global shapes, the dimension TP splits), computes
which global slice of every tensor each rank of a layout holds, and counts the bytes a new
rank lacks on a device by intersecting slices. It then enumerates every placement that keeps
each TP group inside one node (inside one island with a declared NVLink island size), keeps
the fewest nodes (pinned node always kept), and, for `resilient`, keeps a replica of every
(pp, tp) slice off each node. The planner must match its optimum exactly.
"""
from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from migrate import LayoutError, LostStateError, MigrationPlan, ModelSpec, ParallelConfig, RankMap, Topology, plan

from tests.migrate.firstprinciples import Gpt, fsdp_masks, lacking, lacking_masks

GPT = Gpt(layers=12, hidden=48, ffn=96, vocab=96, seq=8)
MODEL = ModelSpec(layers=12, hidden=48, heads=12, ffn=96, vocab=96, seq_len=8)


class Oracle:
    """Every placement of `curr` on the alive devices, scored (nodes kept, bytes moved)."""

    def __init__(self, prev: ParallelConfig, prev_devices: tuple[int, ...], curr: ParallelConfig,
                 sizes: list[int], failed: set[int], island: int | None, resilient: bool) -> None:
        self.curr, self.resilient = curr, resilient and curr.dp >= 2
        self.node_of, self.island_of = [], []
        for n, size in enumerate(sizes):
            for g in range(size):
                self.node_of.append(n)
                self.island_of.append((n, g // island if island and curr.tp <= island else 0))
        self.alive = [d for d in range(sum(sizes)) if d not in failed]
        holds = {}
        for r, d in enumerate(prev_devices):
            if d not in failed:
                pp, tp = r // (prev.tp * prev.dp), r % prev.tp
                holds[d] = GPT.held(pp, tp, prev.pp, prev.tp)
        self.cost = {}
        for p in range(curr.pp):
            for t in range(curr.tp):
                want = GPT.held(p, t, curr.pp, curr.tp)
                for d in self.alive:
                    self.cost[p, t, d] = lacking(want, holds.get(d, {}))
        self.pinned_alive = {0} if any(self.node_of[d] == 0 for d in self.alive) else set()

    def score(self, devices: tuple[int, ...]) -> tuple[int, int]:
        c = self.curr
        nodes = {self.node_of[d] for d in devices} | self.pinned_alive
        moved = sum(self.cost[r // (c.tp * c.dp), r % c.tp, d] for r, d in enumerate(devices))
        return len(nodes), moved

    def in_node(self, devices: tuple[int, ...]) -> bool:
        c = self.curr
        return all(len({self.island_of[devices[c.rank(p, q, t)]] for t in range(c.tp)}) == 1
                   for p in range(c.pp) for q in range(c.dp))

    def survives_a_node(self, devices: tuple[int, ...]) -> bool:
        c = self.curr
        return all(len({self.node_of[devices[c.rank(p, q, t)]] for q in range(c.dp)}) >= 2
                   for p in range(c.pp) for t in range(c.tp))

    def placements(self, node_rule: bool):
        """Every placement, DP replicas of a stage in canonical order (they are interchangeable)."""
        c = self.curr
        groups = [(p, q) for p in range(c.pp) for q in range(c.dp)]
        devices = [-1] * c.world_size

        def rec(gi: int, used: frozenset, last_min: dict):
            if gi == len(groups):
                yield tuple(devices)
                return
            p, q = groups[gi]
            for members in itertools.permutations([d for d in self.alive if d not in used], c.tp):
                if node_rule and len({self.island_of[d] for d in members}) > 1:
                    continue
                if q and min(members) < last_min[p]:
                    continue
                for t, d in enumerate(members):
                    devices[c.rank(p, q, t)] = d
                yield from rec(gi + 1, used | set(members), {**last_min, p: min(members)})

        yield from rec(0, frozenset(), {})

    def best(self) -> tuple[int, int]:
        """(fewest nodes, fewest bytes) over the allowed placements, relaxing rules that nothing meets."""
        for node_rule in (True, False):
            for resilient in ((True, False) if self.resilient else (False,)):
                scores = [self.score(d) for d in self.placements(node_rule)
                          if not resilient or self.survives_a_node(d)]
                if scores:
                    return min(scores)
        raise AssertionError("no placement at all")


DIV = [1, 2, 3, 4, 6]


@st.composite
def cases(draw):
    sizes = draw(st.lists(st.integers(2, 4), min_size=1, max_size=4).filter(lambda s: sum(s) <= 10))
    total = sum(sizes)
    prev = draw(st.builds(ParallelConfig, pp=st.sampled_from(DIV), tp=st.sampled_from([1, 2, 3, 4]),
                          dp=st.sampled_from([1, 2, 3])))
    assume(prev.world_size <= total)
    order = draw(st.permutations(range(total)))
    prev_devices = tuple(order[:prev.world_size])
    failed = draw(st.sets(st.sampled_from(prev_devices), max_size=2))
    curr = draw(st.builds(ParallelConfig, pp=st.sampled_from(DIV), tp=st.sampled_from([1, 2, 3, 4]),
                          dp=st.sampled_from([1, 2, 3])))
    alive = total - len(failed)
    assume(curr.world_size <= min(alive, 6))
    # keep the enumeration small: permutations of alive devices per group, roughly
    assume(math.perm(alive, min(alive, curr.world_size)) // math.factorial(curr.dp) <= 40000)
    island = draw(st.sampled_from([None, None, 2]))
    placement = draw(st.sampled_from(["packed", "resilient"]))
    return sizes, prev, prev_devices, frozenset(failed), curr, island, placement


def _plan(sizes, prev, prev_devices, failed, curr, island, placement):
    topo = Topology.of_nodes(sizes, tp_domain=island)
    try:
        return plan(MODEL, RankMap(prev, prev_devices), curr, topo, failed, placement=placement)
    except LostStateError:
        return None


def check_against_oracle(sizes, prev, prev_devices, failed, curr, island, placement):
    p = _plan(sizes, prev, prev_devices, failed, curr, island, placement)
    if p is None:
        return
    oracle = Oracle(prev, prev_devices, curr, sizes, set(failed), island, placement == "resilient")
    nodes, best = oracle.best()
    got_nodes, got = oracle.score(p.curr.devices)
    # the oracle's own count of the planner's placement agrees with the planner's byte model
    assert got == p.bytes_moved
    assert (got_nodes, got) == (nodes, best), f"planner {got_nodes} nodes {got} B, oracle {nodes} nodes {best} B"
    if not any("span" in n for n in p.notes):
        assert oracle.in_node(p.curr.devices)
    if placement == "resilient" and curr.dp >= 2 and not any("a node loss loses state" in n for n in p.notes):
        assert oracle.survives_a_node(p.curr.devices)
    assert p.optimal
    assert p.bytes_lower_bound_no_rule <= p.bytes_lower_bound <= p.bytes_moved


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(cases())
def test_placement_is_the_brute_force_optimum_under_the_node_rule(case):
    check_against_oracle(*case)


@pytest.mark.parametrize("sizes,prev,prev_devices,failed,curr,island,placement", [
    ([4, 4, 2, 2], "pp2tp2", (0, 1, 2, 3), (), "pp1tp2dp2", None, "packed"),
    ([4, 4, 2, 2], "pp2tp2dp2", (0, 1, 4, 5, 2, 3, 6, 7), (5,), "pp2tp2", None, "packed"),
    ([4, 4, 2, 2], "pp2tp2", (8, 9, 10, 11), (), "pp1tp4", None, "packed"),
    ([4, 4, 2, 2], "pp2dp2", (0, 4, 1, 5), (), "pp2dp2", None, "resilient"),
    ([4, 2], "pp3tp2", (0, 1, 2, 3, 4, 5), (2,), "pp2tp2", None, "packed"),
    ([4, 2], "pp2dp2", (0, 1, 2, 3), (), "pp2dp2", None, "resilient"),
    ([4, 4], "pp2tp2", (0, 1, 2, 3), (), "pp2tp2", 2, "packed"),
    ([2, 2], "pp2dp2", (0, 1, 2, 3), (0,), "pp2", None, "resilient"),
])
def test_uneven_nodes_and_islands(sizes, prev, prev_devices, failed, curr, island, placement):
    check_against_oracle(sizes, ParallelConfig.parse(prev), prev_devices, frozenset(failed),
                         ParallelConfig.parse(curr), island, placement)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(cases())
def test_the_exact_program_alone_finds_the_optimum(case):
    """With the greedy pass switched off every plan comes from the integer program."""
    import migrate.allocator as allocator

    original = allocator._Solver._greedy
    allocator._Solver._greedy = lambda self: None
    try:
        check_against_oracle(*case)
    finally:
        allocator._Solver._greedy = original


def test_initial_placement_packed_and_resilient():
    from migrate.allocator import initial_placement, survives_node_loss

    topo = Topology.grid(2, 2)
    layout = ParallelConfig.parse("pp2dp2")
    packed, _ = initial_placement(layout, topo, "packed")
    assert packed == (0, 1, 2, 3) and not survives_node_loss(layout, packed, topo)
    resilient, notes = initial_placement(layout, topo, "resilient")
    assert survives_node_loss(layout, resilient, topo) and not notes
    # uneven nodes: TP-2 groups only where two GPUs are free, replicas apart, fewest nodes
    topo = Topology.of_nodes([4, 4, 2, 2])
    layout = ParallelConfig.parse("pp2tp2dp2")
    devices, _ = initial_placement(layout, topo, "resilient")
    assert survives_node_loss(layout, devices, topo)
    assert {topo.devices[d].node for d in devices} == {"node0", "node1"}
    # one node cannot keep a replica elsewhere: packed, and the note says so
    devices, notes = initial_placement(ParallelConfig.parse("pp2dp2"), Topology.grid(1, 4), "resilient")
    assert sorted(devices) == [0, 1, 2, 3] and any("node loss" in n for n in notes)


SMALL = Gpt(layers=4, hidden=16, ffn=32, vocab=32, seq=8)
SMALL_MODEL = ModelSpec(layers=4, hidden=16, heads=4, ffn=32, vocab=32, seq_len=8)


class ShardedOracle(Oracle):
    """The same search for layouts with FSDP: a class is (pp, fsdp, tp), each holds a box of every tensor
    (firstprinciples.fsdp_masks, element masks), ranks in torchtitan's order ((pp * dp + q) * F + f) * T + t."""

    def __init__(self, prev: ParallelConfig, prev_devices: tuple[int, ...], curr: ParallelConfig,
                 sizes: list[int], failed: set[int], resilient: bool) -> None:
        super().__init__(ParallelConfig(), (), ParallelConfig(), sizes, failed, None, False)
        self.curr, self.resilient = curr, resilient and curr.dp >= 2

        def who(cfg: ParallelConfig, r: int) -> tuple[int, int, int]:
            t, rest = r % cfg.tp, r // cfg.tp
            return rest // (cfg.fsdp * cfg.dp), rest % cfg.fsdp, t

        holds = {d: fsdp_masks(SMALL, *who(prev, r), prev.pp, prev.fsdp, prev.tp)
                 for r, d in enumerate(prev_devices) if d not in failed}
        self.who = lambda r: who(curr, r)
        self.cost = {}
        for p in range(curr.pp):
            for f in range(curr.fsdp):
                for t in range(curr.tp):
                    want = fsdp_masks(SMALL, p, f, t, curr.pp, curr.fsdp, curr.tp)
                    for d in self.alive:
                        self.cost[p, f, t, d] = lacking_masks(want, holds.get(d, {}))

    def rank(self, p: int, q: int, f: int, t: int) -> int:
        c = self.curr
        return ((p * c.dp + q) * c.fsdp + f) * c.tp + t

    def score(self, devices: tuple[int, ...]) -> tuple[int, int]:
        nodes = {self.node_of[d] for d in devices} | self.pinned_alive
        return len(nodes), sum(self.cost[(*self.who(r), d)] for r, d in enumerate(devices))

    def survives_a_node(self, devices: tuple[int, ...]) -> bool:
        c = self.curr
        return all(len({self.node_of[devices[self.rank(p, q, f, t)]] for q in range(c.dp)}) >= 2
                   for p in range(c.pp) for f in range(c.fsdp) for t in range(c.tp))

    def placements(self, node_rule: bool):
        c = self.curr
        groups = [(p, f, q) for p in range(c.pp) for f in range(c.fsdp) for q in range(c.dp)]
        devices = [-1] * c.world_size

        def rec(gi: int, used: frozenset, last_min: dict):
            if gi == len(groups):
                yield tuple(devices)
                return
            p, f, q = groups[gi]
            for members in itertools.permutations([d for d in self.alive if d not in used], c.tp):
                if node_rule and len({self.node_of[d] for d in members}) > 1:
                    continue
                if q and min(members) < last_min[p, f]:
                    continue
                for t, d in enumerate(members):
                    devices[self.rank(p, q, f, t)] = d
                yield from rec(gi + 1, used | set(members), {**last_min, (p, f): min(members)})

        yield from rec(0, frozenset(), {})


@pytest.mark.parametrize("sizes,prev,prev_devices,failed,curr,placement", [
    ([2, 2], "tp2fsdp2", (0, 1, 2, 3), (), "tp2", "packed"),
    ([2, 2], "tp2", (2, 3), (), "tp2fsdp2", "packed"),
    ([2, 2], "tp2dp2", (0, 1, 2, 3), (), "tp2fsdp2", "packed"),
    ([2, 2, 2], "hsdp2x2", (0, 1, 2, 3), (1,), "fsdp2", "resilient"),
    ([4, 4], "tp2hsdp2x2", (0, 1, 2, 3, 4, 5, 6, 7), (2, 5), "tp2fsdp2", "packed"),
    ([4, 2], "fsdp4", (0, 1, 2, 3), (), "pp2fsdp2", "packed"),
    ([2, 2, 2], "pp2fsdp2", (4, 5, 0, 1), (), "fsdp2", "packed"),
    ([2, 2], "fsdp2", (0, 2), (), "hsdp2x2", "resilient"),
])
def test_fsdp_plans_are_the_brute_force_optimum_by_bytes(sizes, prev, prev_devices, failed, curr, placement):
    """`elastic plan` between layouts with FSDP (bytes by manifest, box overlaps): the placement's bytes are
    the brute-force optimum counted on element masks, and what the plan says it moves."""
    prev, curr = ParallelConfig.parse(prev), ParallelConfig.parse(curr)
    topo = Topology.of_nodes(sizes)
    p = plan(SMALL_MODEL, RankMap(prev, prev_devices), curr, topo, frozenset(failed), placement=placement)
    oracle = ShardedOracle(prev, prev_devices, curr, sizes, set(failed), placement == "resilient")
    nodes, best = oracle.best()
    assert oracle.score(p.curr.devices) == (nodes, best) == (nodes, p.bytes_moved), p.summary()
    assert p.optimal and p.bytes_lower_bound == p.bytes_moved
    assert p.bytes_state_total == SMALL_MODEL.state_bytes
    d = json.loads(p.to_json())  # `elastic plan --json --instructions`: the moves, not GPT instructions
    assert d["by_manifest"] and sum(m["nbytes"] for m in d["instructions"] if m["op"] == "send") == p.bytes_moved
    with pytest.raises(LayoutError, match="plan it again"):
        MigrationPlan.from_dict(d)


def test_an_fsdp_shard_on_a_failed_device_alone_is_lost_state() -> None:
    """FSDP without replicas: a failed device's shard has no other holder; the plan says what is lost."""
    with pytest.raises(LostStateError, match="held by no old rank"):
        plan(SMALL_MODEL, RankMap(ParallelConfig.parse("pp2fsdp2"), (4, 5, 0, 1)), ParallelConfig.parse("fsdp2"),
             Topology.of_nodes([2, 2, 2]), frozenset({0}))
