"""Planner behaviour a user relies on: validation, failures, placement, serialisation."""
import json

import pytest

from migrate import LayoutError, LostStateError, MigrationPlan, ModelSpec, ParallelConfig, Topology, plan
from tests.migrate.sim import apply, layout_state

MODEL = ModelSpec(layers=24, hidden=256, heads=8, vocab=1024)


def cfg(s: str) -> ParallelConfig:
    return ParallelConfig.parse(s)


@pytest.mark.parametrize("text,expected", [("pp4tp2dp1", (4, 2, 1)), ("tp2pp4", (4, 2, 1)), ("dp3", (1, 1, 3)),
                                           ("PP2", (2, 1, 1))])
def test_parse_layouts(text, expected):
    c = cfg(text)
    assert (c.pp, c.tp, c.dp) == expected


@pytest.mark.parametrize("text", ["", "pp", "pp0", "pp2pp2", "pp2x", "tp-1", "ppfour"])
def test_bad_layouts_are_refused(text):
    with pytest.raises(LayoutError):
        cfg(text)


@pytest.mark.parametrize("kwargs,words", [
    ({"layers": 0, "hidden": 64}, "layers"), ({"layers": 4, "hidden": -8}, "hidden"),
    ({"layers": 4, "hidden": 64, "heads": 3}, "divisible"), ({"layers": 4, "hidden": 64, "dtype": "int8"}, "dtype")])
def test_bad_models_are_refused(kwargs, words):
    with pytest.raises(LayoutError, match=words):
        ModelSpec(**kwargs)


def test_layout_must_split_the_model():
    with pytest.raises(LayoutError, match="not divisible by pp=5"):
        plan(MODEL, cfg("pp5"), cfg("pp2"), Topology.grid(1, 8))
    with pytest.raises(LayoutError, match="heads=8 is not divisible by tp=3"):
        plan(MODEL, cfg("pp2"), cfg("tp3"), Topology.grid(1, 8))


def test_device_counts_and_failures_are_checked():
    with pytest.raises(LayoutError, match="needs 16 devices but only 8"):
        plan(MODEL, cfg("pp4tp2"), cfg("pp4tp4"), Topology.grid(1, 8))
    with pytest.raises(LayoutError, match="9 failed devices but the old layout has only 8"):
        plan(MODEL, cfg("pp4tp2"), cfg("pp2"), Topology.grid(2, 8), failed=set(range(9)))
    with pytest.raises(LayoutError, match=r"failed device\(s\) \[12\] do not run the old layout"):
        plan(MODEL, cfg("pp4tp2"), cfg("pp2"), Topology.grid(2, 8), failed={12})


def test_failed_device_is_recovered_from_a_replica():
    topo = Topology.grid(2, 8)
    p = plan(MODEL, cfg("pp4tp2dp2"), cfg("pp4tp2dp1"), topo, failed={0})
    assert apply(p) == layout_state(p, "curr")
    assert 0 not in p.curr.devices
    # the failed rank (pp0 dp0 tp0) is rebuilt from its replica, rank 2 on device 2
    assert any(i.op == "send" and i.src == 2 for i in p.instructions) or 2 in p.curr.devices


def test_lost_state_names_what_is_lost():
    with pytest.raises(LostStateError) as info:
        plan(MODEL, cfg("pp4tp2dp2"), cfg("pp4tp2dp1"), Topology.grid(2, 8), failed={3, 1})
    msg = str(info.value)
    assert "pp stage 0 tp rank 1" in msg and "[1, 3]" in msg and "checkpoint" in msg


def test_cross_replica_pairing_moves_less_than_the_paper():
    """PP4TP2DP3 -> PP4TP8DP1: each new TP-8 group can reuse slices held by three different replicas."""
    p = plan(MODEL, cfg("pp4tp2dp3"), cfg("pp4tp8dp1"), Topology.grid(4, 8), tp_in_node=False)
    one_replica = plan(MODEL, cfg("pp4tp2dp1"), cfg("pp4tp8dp1"), Topology.grid(4, 8), tp_in_node=False)
    assert p.bytes_moved < one_replica.bytes_moved
    assert apply(p) == layout_state(p, "curr")


def test_scale_in_releases_whole_nodes_and_keeps_the_pinned_one():
    topo = Topology.grid(4, 4, pinned=("node2",))
    p = plan(MODEL, cfg("pp4tp2dp2"), cfg("pp2tp2dp1"), topo)
    assert "node2" not in p.nodes_released
    used = {topo.devices[d].node for d in p.curr.devices}
    assert len(used) == 1 and len(p.nodes_released) == 3


def test_replicas_share_the_sending():
    p = plan(MODEL, cfg("pp2dp2"), cfg("pp4dp2"), Topology.grid(2, 4))
    sends = p._per_device("send", "src")
    assert len(sends) >= 2 and p.max_device_send_bytes < sum(sends.values())


def test_plan_round_trips_through_json():
    p = plan(MODEL, cfg("pp4tp2"), cfg("pp6tp4"), Topology.grid(6, 4))
    q = MigrationPlan.from_dict(json.loads(p.to_json()))
    assert q.instructions == p.instructions and q.curr == p.curr and q.bytes_moved == p.bytes_moved
