"""The launcher's side of a live-mode (launcher.runtime) job, pure: ranks placed by the ETC planner over
the state manifests the workers offer, and whether the replicas left after a failure cover the state.
Expected results by hand for 2 nodes x 2 devices, tp2dp2 in device order: node0 holds DP replica 0
(TP ranks 0, 1), node1 replica 1, so any loss that leaves one holder of each TP rank is covered."""
from __future__ import annotations

import json
import types

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from launcher.loop import live_plan
from migrate.layout import LayoutError, ParallelConfig
from migrate.manifest import Manifest, ManifestError, plan_manifest
from migrate.topology import RankMap, Topology

TP2DP2, TP2DP1 = ParallelConfig.parse("tp2dp2"), ParallelConfig.parse("tp2dp1")


def _launcher(placement: str = "packed"):
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    manifests = {"pp1tp1": [plan_manifest(mlp, plan, 1, 0).to_list()],
                 "pp1tp2": [plan_manifest(mlp, plan, 2, t).to_list() for t in range(2)]}
    spec = json.loads(json.dumps({"kind": "generic", "manifests": manifests}))
    return types.SimpleNamespace(ctl=types.SimpleNamespace(model=lambda: spec), topology=Topology.grid(2, 2),
                                 opts=types.SimpleNamespace(placement=placement))


@pytest.mark.parametrize("failed, kept", [([3], (0, 1)), ([2], (0, 1)), ([0, 1], (2, 3)), ([0], (2, 3))])
def test_a_failure_that_leaves_a_replica_keeps_its_devices(failed, kept) -> None:
    la, old = _launcher(), RankMap(TP2DP2, (0, 1, 2, 3))
    devices = live_plan.placement(la.ctl.model(), la.topology, la.opts.placement, TP2DP1, old, ["node0", "node1"], failed)
    assert devices == kept  # the surviving full replica: nothing moves
    cost = live_plan.plan_bytes(la.ctl.model(), old, RankMap(TP2DP1, devices), failed)
    # by hand: Linear(4, 8) + Linear(8, 4) in fp32 with Adam's two moments and a step per parameter,
    # every piece once (the row-parallel bias is replicated)
    state = (3 * (8 * 4 + 8 + 4 * 8 + 4) + 4) * 4
    assert cost == {"bytes_moved": 0, "bytes_state_total": state, "bytes_checkpoint": 2 * state}


def test_losing_both_holders_of_a_tp_shard_is_not_covered() -> None:
    la, old = _launcher(), RankMap(TP2DP2, (0, 1, 2, 3))
    devices = live_plan.placement(la.ctl.model(), la.topology, la.opts.placement, TP2DP1, old, ["node0", "node1"], [1, 3])
    with pytest.raises(ManifestError, match="held by no old rank"):
        live_plan.plan_bytes(la.ctl.model(), old, RankMap(TP2DP1, devices), [1, 3])


def test_ranks_stay_off_nodes_outside_the_target_and_tp_groups_stay_inside_a_node() -> None:
    la, old = _launcher(), RankMap(TP2DP2, (0, 1, 2, 3))
    assert live_plan.placement(la.ctl.model(), la.topology, la.opts.placement, TP2DP1, old, ["node1"]) == (2, 3)
    assert live_plan.placement(la.ctl.model(), la.topology, la.opts.placement, TP2DP2, RankMap(TP2DP1, (2, 3)), ["node0", "node1"]) in \
        ((0, 1, 2, 3), (2, 3, 0, 1))


def test_a_shape_the_workers_offered_no_manifests_for_is_one_line() -> None:
    with pytest.raises(LayoutError, match="no state manifests for pp1tp4"):
        live_plan.class_manifests(_launcher().ctl.model(), ParallelConfig.parse("tp4"))
    assert live_plan.rank_manifests(_launcher().ctl.model(), TP2DP2)[3] == Manifest.from_list(
        _launcher().ctl.model()["manifests"]["pp1tp2"][1])


def test_a_shrink_moves_the_shards_the_kept_rank_lacks() -> None:
    la, old = _launcher(), RankMap(TP2DP2, (0, 1, 2, 3))
    cost = live_plan.plan_bytes(la.ctl.model(), old, RankMap(ParallelConfig.parse("pp1tp1"), (0,)), [])
    # device 0 keeps TP shard 0, the replicated bias and the steps; by hand it lacks half of each split
    # tensor and of its two moments
    assert cost["bytes_moved"] == 3 * (8 * 4 // 2 + 8 // 2 + 4 * 8 // 2) * 4
    assert cost["bytes_state_total"] == (3 * (8 * 4 + 8 + 4 * 8 + 4) + 4) * 4


def test_layouts_the_reference_model_cannot_take_are_refused_with_the_reason() -> None:
    from launcher.policy.layouts import NoLayoutError
    from migrate.layout import ModelSpec

    la = types.SimpleNamespace(model=ModelSpec(layers=4, hidden=128, vocab=512, seq_len=32), tp_fit=2,
                               opts=types.SimpleNamespace(layouts=[ParallelConfig.parse("pp3"),
                                                                   ParallelConfig.parse("pp2")]))
    assert str(live_plan.choose(3, la.tp_fit, la.opts.layouts, la.model)) == "pp2tp1dp1"  # 3 devices fit pp3, but 4 layers do not split in 3
    la.opts.layouts = [ParallelConfig.parse("pp3")]
    with pytest.raises(NoLayoutError, match="pp3tp1dp1.*layers"):
        live_plan.choose(3, la.tp_fit, la.opts.layouts, la.model)
