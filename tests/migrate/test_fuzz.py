"""Fuzzing the planner's inputs: any input gives a correct plan or a LayoutError, nothing else.

The default suite runs a few hundred cases; `pytest -m fuzz` runs 10,000 (not in the default suite).
"""
import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from migrate import LayoutError, ModelSpec, ParallelConfig, Topology, plan
from tests.migrate.sim import apply, layout_state

layout_text = st.one_of(
    st.builds(lambda pp, tp, dp: f"pp{pp}tp{tp}dp{dp}", st.sampled_from([1, 2, 3, 4, 6]),
              st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3])),
    st.builds(lambda pp, tp, dp: f"pp{pp}tp{tp}dp{dp}", st.integers(0, 9), st.integers(0, 9), st.integers(0, 4)),
    st.text(alphabet="ptd0123456789x -", max_size=12),
)
model_kwargs = st.one_of(st.fixed_dictionaries(dict(
    layers=st.just(12), hidden=st.just(64), heads=st.sampled_from([4, 8]), ffn=st.sampled_from([0, 128]),
    vocab=st.just(64), seq_len=st.just(8), dtype=st.sampled_from(["fp32", "bf16"]),
    optimizer=st.sampled_from(["adam", "none"]))), st.fixed_dictionaries(dict(layers=st.integers(-2, 24), hidden=st.sampled_from([0, 48, 64, 96, -64]),
                   heads=st.sampled_from([0, 1, 2, 3, 4, 6, 8]), ffn=st.sampled_from([0, 96, 100, 192]),
                   vocab=st.sampled_from([64, 96, 100]), seq_len=st.just(8),
                   dtype=st.sampled_from(["fp32", "bf16", "fp8"]), optimizer=st.sampled_from(["adam", "none", "sgd"]))))


def _check(kwargs, prev_s, curr_s, gpn, failed_list) -> str:
    try:
        model = ModelSpec(**kwargs)
        prev, curr = ParallelConfig.parse(prev_s), ParallelConfig.parse(curr_s)
        nodes = max(1, math.ceil(max(prev.world_size, curr.world_size) / max(gpn, 1)) + 1)
        p = plan(model, prev, curr, Topology.grid(nodes, gpn), frozenset(failed_list))
    except LayoutError:
        return "refused"
    assert apply(p) == layout_state(p, "curr")
    return "planned"


def _test(data):
    outcome = _check(data.draw(model_kwargs), data.draw(layout_text), data.draw(layout_text),
                     data.draw(st.integers(1, 8)), data.draw(st.lists(st.integers(-2, 40), max_size=4) | st.lists(st.integers(0, 5), max_size=2)))
    event(outcome)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_planner_inputs_fuzz_quick(data):
    _test(data)


@pytest.mark.fuzz
@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_planner_inputs_fuzz_long(data):
    _test(data)
