"""plan(..., unusable=...): devices whose worker died earlier get no rank of the new layout."""
from __future__ import annotations

from migrate.layout import ModelSpec, ParallelConfig
from migrate.plan import plan
from migrate.topology import RankMap, Topology


def test_unusable_devices_get_no_rank() -> None:
    model = ModelSpec(layers=4, hidden=128)
    topo = Topology.grid(2, 2, names=["a", "b"])
    prev = RankMap(ParallelConfig.parse("pp2"), (0, 1))  # devices 2 and 3 stand by
    free = plan(model, prev, ParallelConfig.parse("pp2dp1"), topo)
    assert set(free.curr.devices) == {0, 1}
    p = plan(model, RankMap(ParallelConfig.parse("pp2"), (0, 2)), ParallelConfig.parse("pp1dp2"), topo,
             unusable=frozenset({1, 3}))
    assert set(p.curr.devices) == {0, 2}
    # a replica's device failed now, another device died before: neither gets a rank
    p = plan(model, RankMap(ParallelConfig.parse("pp1dp2"), (0, 2)), ParallelConfig.parse("pp1dp2"), topo,
             failed=frozenset({2}), unusable=frozenset({1}))
    assert set(p.curr.devices) == {0, 3}
