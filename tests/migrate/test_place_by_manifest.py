"""The placement interface takes any byte workload: state manifests give the same placement."""
import pytest

from migrate import ModelSpec, ParallelConfig, Topology, plan
from migrate.manifest import Manifest, class_cost, gpt_manifest, layout_manifests
from migrate.plan import place
from migrate.topology import RankMap

MODEL = ModelSpec(layers=12, hidden=64, heads=4, ffn=128, vocab=128, seq_len=8)


@pytest.mark.parametrize("prev,curr,sizes,failed", [
    ("pp4tp2", "pp2tp4", [4, 4], ()), ("pp2tp2dp2", "pp2tp2", [4, 4, 2, 2], (1,)), ("pp3tp2", "pp6tp1dp2", [4, 4, 4], ()),
])
def test_manifest_workload_places_like_the_byte_model(prev, curr, sizes, failed):
    a, b = ParallelConfig.parse(prev), ParallelConfig.parse(curr)
    topo = Topology.of_nodes(sizes)
    cost = class_cost(layout_manifests(b, lambda r: gpt_manifest(MODEL, b, r)),
                      layout_manifests(a, lambda r: gpt_manifest(MODEL, a, r)) + [Manifest(())])
    by_manifest = place(b, cost, RankMap.identity(a), topo, frozenset(failed), placement="resilient")
    p = plan(MODEL, a, b, topo, frozenset(failed), placement="resilient")
    assert by_manifest.optimal and p.optimal
    assert sum(cost[:, -1]) * b.dp - by_manifest.retained == p.bytes_moved
