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

from launcher import runtime_moves
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
    devices = runtime_moves.placement(la, TP2DP1, old, ["node0", "node1"], failed)
    assert devices == kept  # the surviving full replica: nothing moves
    runtime_moves.check_covered(la, old, RankMap(TP2DP1, devices), failed)


def test_losing_both_holders_of_a_tp_shard_is_not_covered() -> None:
    la, old = _launcher(), RankMap(TP2DP2, (0, 1, 2, 3))
    devices = runtime_moves.placement(la, TP2DP1, old, ["node0", "node1"], [1, 3])
    with pytest.raises(ManifestError, match="held by no old rank"):
        runtime_moves.check_covered(la, old, RankMap(TP2DP1, devices), [1, 3])


def test_ranks_stay_off_nodes_outside_the_target_and_tp_groups_stay_inside_a_node() -> None:
    la, old = _launcher(), RankMap(TP2DP2, (0, 1, 2, 3))
    assert runtime_moves.placement(la, TP2DP1, old, ["node1"]) == (2, 3)
    assert runtime_moves.placement(la, TP2DP2, RankMap(TP2DP1, (2, 3)), ["node0", "node1"]) in \
        ((0, 1, 2, 3), (2, 3, 0, 1))


def test_a_shape_the_workers_offered_no_manifests_for_is_one_line() -> None:
    with pytest.raises(LayoutError, match="no state manifests for pp1tp4"):
        runtime_moves.class_manifests(_launcher(), ParallelConfig.parse("tp4"))
    assert runtime_moves.rank_manifests(_launcher(), TP2DP2)[3] == Manifest.from_list(
        _launcher().ctl.model()["manifests"]["pp1tp2"][1])
