"""The layout policy: a pure function from devices to a valid PP x TP x DP layout."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.policy.layouts import NoLayoutError, check_node_range, choose_layout, idle_note, why_invalid
from migrate.layout import ModelSpec, ParallelConfig

P = ParallelConfig.parse
MODEL = ModelSpec(layers=24, hidden=512)  # 8 heads


def test_listed_layouts_most_devices_wins_ties_to_earlier():
    layouts = [P("pp4tp2"), P("pp2tp4"), P("pp2tp2")]
    assert choose_layout(16, 4, layouts, MODEL) == P("pp4tp2")
    assert choose_layout(8, 4, layouts, MODEL) == P("pp4tp2")
    assert choose_layout(7, 4, layouts, MODEL) == P("pp2tp2")
    assert choose_layout(4, 4, layouts, MODEL) == P("pp2tp2")


def test_tp_must_stay_inside_a_node():
    assert choose_layout(8, 2, [P("pp2tp4"), P("pp4tp2")], MODEL) == P("pp4tp2")
    assert "inside" in why_invalid(P("tp4"), 8, 2, MODEL)


def test_model_divisibility_rules_out_layouts():
    odd = ModelSpec(layers=6, hidden=192)  # 3 heads
    with pytest.raises(NoLayoutError, match="not divisible"):
        choose_layout(8, 4, [P("pp4"), P("tp2")], odd)
    assert choose_layout(8, 4, [P("pp4"), P("pp2dp2")], odd) == P("pp2dp2")


def test_no_devices_and_nothing_fits():
    with pytest.raises(NoLayoutError):
        choose_layout(0, 4)
    with pytest.raises(NoLayoutError, match="needs 8 devices"):
        choose_layout(4, 4, [P("pp4tp2")], MODEL)


def test_node_range_check_names_the_node_count():
    check_node_range(2, 4, 4, [P("pp4tp2"), P("pp2tp2")], MODEL)
    with pytest.raises(NoLayoutError, match="with 1 node"):
        check_node_range(1, 4, 4, [P("pp4tp2")], MODEL)


@settings(max_examples=200, deadline=None)
@given(devices=st.integers(1, 64), gpn=st.sampled_from([1, 2, 4, 8]), layers=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 24]),
       heads=st.sampled_from([1, 2, 3, 4, 8]))
def test_free_choice_is_valid_and_uses_as_many_devices_as_any_valid_layout(devices, gpn, layers, heads):
    model = ModelSpec(layers=layers, hidden=64 * heads, heads=heads, vocab=1024)
    cfg = choose_layout(devices, gpn, (), model)
    assert cfg.world_size <= devices
    assert gpn % cfg.tp == 0
    assert layers % cfg.pp == 0 and heads % cfg.tp == 0
    # dp alone is always valid, so the choice uses every device
    assert cfg.world_size == devices


@settings(max_examples=200, deadline=None)
@given(devices=st.integers(1, 32), picks=st.lists(st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]),
                                                            st.sampled_from([1, 2])), min_size=1, max_size=5))
def test_listed_choice_is_a_valid_member_with_the_most_devices(devices, picks):
    layouts = [ParallelConfig(pp=a, tp=b, dp=c) for a, b, c in picks]
    valid = [c for c in layouts if why_invalid(c, devices, 4, MODEL) is None]
    if not valid:
        with pytest.raises(NoLayoutError):
            choose_layout(devices, 4, layouts, MODEL)
        return
    cfg = choose_layout(devices, 4, layouts, MODEL)
    assert cfg in valid
    assert cfg.world_size == max(c.world_size for c in valid)


def test_uneven_nodes_seat_tp_groups_inside_nodes():
    sizes = (4, 4, 2, 2)
    assert choose_layout(12, sizes, [P("pp2tp4dp1"), P("pp3tp4"), P("pp2tp2dp3")], MODEL) == P("pp2tp2dp3")
    assert "seat only 2 TP groups of 4" in why_invalid(P("pp3tp4"), 12, sizes, MODEL)
    assert "does not fit inside any node" in why_invalid(P("tp8"), 12, sizes, MODEL)
    with pytest.raises(NoLayoutError, match="without a TP group spanning nodes"):
        choose_layout(12, sizes, [P("pp3tp4")], MODEL)
    assert choose_layout(12, sizes, (), MODEL).world_size == 12


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=5),
       layers=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 24]), heads=st.sampled_from([1, 2, 4, 8]))
def test_free_choice_on_uneven_nodes_fits_inside_nodes(sizes, layers, heads):
    model = ModelSpec(layers=layers, hidden=64 * heads, heads=heads, vocab=1024)
    devices = sum(sizes)
    cfg = choose_layout(devices, sizes, (), model)
    assert sum(s // cfg.tp for s in sizes) >= cfg.pp * cfg.dp  # every TP group inside one node
    assert cfg.world_size == devices  # dp alone always fits


def every_valid_layout(devices: int, gpus_per_node, model) -> list[ParallelConfig]:
    """Brute force: every PP x TP x DP grid up to `devices`, kept when valid, sorted by preference (most
    devices, then less PP, then more TP)."""
    largest = gpus_per_node if isinstance(gpus_per_node, int) else max(gpus_per_node)
    out = [ParallelConfig(pp=pp, tp=tp, dp=dp) for pp in range(1, devices + 1) for tp in range(1, largest + 1)
           for dp in range(1, devices // (pp * tp) + 1)]
    out = [c for c in out if why_invalid(c, devices, gpus_per_node, model) is None]
    return sorted(out, key=lambda c: (-c.world_size, c.pp, -c.tp))


@settings(max_examples=300, deadline=None)
@given(devices=st.integers(1, 40), gpn=st.one_of(st.sampled_from([1, 2, 3, 4, 6, 8]),
                                                 st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=1, max_size=4)),
       layers=st.sampled_from([1, 2, 3, 4, 6, 12]), heads=st.sampled_from([1, 2, 3, 4]), model=st.booleans())
def test_free_choice_is_the_first_of_every_valid_layout_in_preference_order(devices, gpn, layers, heads, model):
    """choose_layout stops at the first valid layout; the oracle lists them all (PP x TP x DP up to the
    devices, each checked) and sorts them: most devices, then less PP, then more TP."""
    spec = ModelSpec(layers=layers, hidden=64 * heads, heads=heads, vocab=1024) if model else None
    gpus = gpn if isinstance(gpn, int) else tuple(gpn)
    every = every_valid_layout(devices, gpus, spec)
    if not every:
        with pytest.raises(NoLayoutError):
            choose_layout(devices, gpus, (), spec)
        return
    assert choose_layout(devices, gpus, (), spec) == every[0]


def test_every_node_count_of_a_large_job_is_checked():
    # 1..4096 nodes of 8 GPUs: listing every layout of every node count did not finish in 60 s
    check_node_range(1, 4096, 8, [], MODEL)
    assert choose_layout(4096 * 8, 8, (), MODEL) == P("pp1tp8dp4096")


def test_a_layout_passed_over_is_said_with_why_and_the_idle_devices() -> None:
    """--layouts pp2tp2,pp2tp1 with a model of 1 attention head on 2 nodes x 2 GPUs: pp2tp1 runs on 2 of the
    4 devices, and the note says TP 2 cannot cut the head (before: 2 GPUs idle without a word)."""
    one_head = ModelSpec(layers=4, hidden=64, heads=1, vocab=256)
    layouts = [ParallelConfig.parse("pp2tp2"), ParallelConfig.parse("pp2tp1")]
    chosen = choose_layout(4, 2, layouts, one_head)
    assert str(chosen) == "pp2tp1dp1"
    note = idle_note(4, 2, layouts, one_head, chosen)
    assert note.startswith("pp2tp1dp1 uses 2 of the 4 devices, 2 idle (pp2tp2")
    assert "head" in note, note
    assert idle_note(4, 2, layouts, ModelSpec(layers=4, hidden=64, heads=2, vocab=256),
                     choose_layout(4, 2, layouts, ModelSpec(layers=4, hidden=64, heads=2, vocab=256))) is None
    assert idle_note(3, 2, [ParallelConfig.parse("pp2tp1")], None, ParallelConfig.parse("pp2tp1")) == \
        "pp2tp1dp1 uses 2 of the 3 devices, 1 idle (no layout in --layouts uses more)"
