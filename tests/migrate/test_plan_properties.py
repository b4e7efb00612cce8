"""Planner invariants over random valid layouts (hypothesis)."""
import itertools
import math

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from migrate import LostStateError, ModelSpec, ParallelConfig, Topology, plan
from migrate.workload import ByteModel, class_workloads
from tests.migrate.sim import apply, layout_state

LAYERS = 12
MODEL = ModelSpec(layers=LAYERS, hidden=48, heads=12, ffn=96, vocab=96, seq_len=8)
DIVISORS = [1, 2, 3, 4, 6]  # of 12 layers and of 12 heads

layouts = st.builds(ParallelConfig, pp=st.sampled_from(DIVISORS), tp=st.sampled_from(DIVISORS),
                    dp=st.sampled_from([1, 2, 3]))


@st.composite
def cases(draw, max_world=24):
    prev, curr = draw(layouts), draw(layouts)
    assume(prev.world_size <= max_world and curr.world_size <= max_world)
    gpn = draw(st.sampled_from([1, 2, 4, 8]))
    failed = draw(st.sets(st.integers(0, prev.world_size - 1), max_size=min(3, prev.world_size - 1)))
    spare = draw(st.integers(0, 4))
    nodes = math.ceil((max(prev.world_size, curr.world_size) + len(failed) + spare) / gpn)
    return prev, curr, Topology.grid(nodes, gpn), frozenset(failed)


def _plan_or_lost(prev, curr, topo, failed, **kw):
    try:
        return plan(MODEL, prev, curr, topo, failed, **kw)
    except LostStateError as exc:
        # only legitimate when some old class has every copy on a failed device
        for pp, tp in itertools.product(range(prev.pp), range(prev.tp)):
            copies = {prev.rank(pp, dp, tp) for dp in range(prev.dp)}
            if copies <= failed:
                assert f"pp stage {pp} tp rank {tp}" in str(exc)
                return None
        raise AssertionError(f"lost-state error although every class survives: {exc}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_instructions_rebuild_exactly_the_target_layout(case):
    prev, curr, topo, failed = case
    p = _plan_or_lost(prev, curr, topo, failed)
    if p is None:
        return
    assert apply(p) == layout_state(p, "curr")
    assert len(set(p.curr.devices)) == curr.world_size and not set(p.curr.devices) & failed
    bm = ByteModel.of_model(MODEL, p.units)
    # bytes moved is exactly what the chosen devices lack
    ws_prev = class_workloads(prev, LAYERS, p.units) + [None]
    ws_curr = class_workloads(curr, LAYERS, p.units)
    rank_on = p.prev.rank_of()
    lacking = 0
    for rank, dev in enumerate(p.curr.devices):
        cpp, _, ctp = curr.coords(rank)
        want = ws_curr[cpp * curr.tp + ctp]
        if dev in rank_on and dev not in failed:
            opp, _, otp = prev.coords(rank_on[dev])
            lacking += int(bm.cost([want], [ws_prev[opp * prev.tp + otp]])[0, 0])
        else:
            lacking += int(bm.need([want])[0])
    assert p.bytes_moved == lacking
    assert 0 <= p.bytes_lower_bound_no_rule <= p.bytes_lower_bound <= p.bytes_moved
    sends = p._per_device("send", "src")
    assert p.max_device_send_bytes == max(sends.values(), default=0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases(max_world=6))
def test_bytes_moved_is_the_brute_force_optimum(case):
    prev, curr, _topo, failed = case
    devices = max(prev.world_size, curr.world_size) + len(failed) + 1  # one node, no node or TP-slot constraint: a pure assignment problem
    topo = Topology.grid(1, devices)
    p = _plan_or_lost(prev, curr, topo, failed, tp_in_node=False)
    if p is None:
        return
    bm = ByteModel.of_model(MODEL, p.units)
    ws_prev = class_workloads(prev, LAYERS, p.units)
    ws_curr = [class_workloads(curr, LAYERS, p.units)[pp * curr.tp + tp]
               for pp, _, tp in map(curr.coords, range(curr.world_size))]
    held = {}
    for rank in range(prev.world_size):
        if rank not in failed:
            pp, _, tp = prev.coords(rank)
            held[rank] = ws_prev[pp * prev.tp + tp]
    alive = [d for d in range(devices) if d not in failed]
    lack = {(r, d): int(bm.need([w])[0]) if d not in held else int(bm.cost([w], [held[d]])[0, 0])
            for r, w in enumerate(ws_curr) for d in alive}
    best = min(sum(lack[r, d] for r, d in enumerate(choice))
               for choice in itertools.permutations(alive, curr.world_size))
    assert p.bytes_moved == best


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_tp_groups_stay_inside_a_node_when_they_fit(case):
    prev, curr, topo, failed = case
    p = _plan_or_lost(prev, curr, topo, failed)
    if p is None:
        return
    room = sum(len([d for d in topo.node_devices(n) if d not in failed]) // curr.tp for n in topo.nodes)
    assert any("span" in n for n in p.notes) == (room < curr.pp * curr.dp)
    if room < curr.pp * curr.dp:
        return
    for pp in range(curr.pp):
        for dp in range(curr.dp):
            nodes = {topo.devices[p.curr.devices[curr.rank(pp, dp, t)]].node for t in range(curr.tp)}
            assert len(nodes) == 1, f"TP group pp{pp} dp{dp} spans {nodes}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_each_device_expands_exactly_its_share_of_the_instructions(case):
    prev, curr, topo, failed = case
    p = _plan_or_lost(prev, curr, topo, failed)
    if p is None:
        return
    from migrate import MigrationPlan

    posted = MigrationPlan.from_dict(p.to_dict(instructions=False))  # what a worker receives
    devices = set(p.curr.devices) | set(p.prev.devices) - set(failed)
    mine = sorted((i.op, i.src, i.dst, i.segment) for d in devices for i in posted.instructions_for(d))
    assert mine == sorted((i.op, i.src, i.dst, i.segment) for i in p.instructions)
    sends, recvs = p._per_device("send"), p._per_device("recv")
    assert sum(recvs.values()) == sum(i.nbytes for i in p.instructions if i.op == "recv") == p.bytes_moved
    assert sends == {d: sum(i.nbytes for i in p.instructions if i.op == "send" and i.src == d)
                     for d in {i.src for i in p.instructions if i.op == "send"}}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_resilient_placement_survives_any_one_node_or_says_why_not(case):
    prev, curr, topo, failed = case
    p = _plan_or_lost(prev, curr, topo, failed, placement="resilient")
    if p is None:
        return
    packed = _plan_or_lost(prev, curr, topo, failed, placement="packed")
    from migrate.allocator import survives_node_loss

    if curr.dp >= 2 and not any("node loss loses state" in n for n in p.notes):
        assert survives_node_loss(curr, p.curr.devices, topo)
    # the rule costs nodes or bytes, never saves them
    used = lambda q: len({topo.devices[d].node for d in q.curr.devices})  # noqa: E731
    assert (used(p), p.bytes_moved) >= (used(packed), packed.bytes_moved)
