"""The paper's Table II reconfigurations (issue 10's table): bytes moved in closed form.

Formulas are derived by hand per row from which slices the old devices hold (s, r: one
layer's TP-split and replicated bytes; Es/Er, Hs/Hr: the embedding's and the head's), at one
64-GPU node (no placement rule binds) and at 8-GPU nodes (a TP group inside one node; the
first node pinned, old ranks on devices in rank order). The byte sizes come from the
first-principles model in tests/migrate/firstprinciples.py, not from the planner.
"""
import pytest

from migrate import ModelSpec, ParallelConfig, Topology, plan
from tests.migrate.firstprinciples import Gpt

GPT = Gpt(layers=24, hidden=64, ffn=256, vocab=256, seq=16)
MODEL = ModelSpec(layers=24, hidden=64, heads=8, ffn=256, vocab=256, seq_len=16)


def one_node(row: str, s, r, Es, Er, Hs, Hr):  # noqa: N803 - the names of the derivation
    return {
        # per stage two new ranks on empty devices lack a quarter of 6 layers and the replicated part
        "pp4tp2>pp4tp4": 12 * s + 48 * r + Es / 2 + 2 * Er + Hs / 2 + 2 * Hr,
        # every new rank sits on an old device holding one of its two quarters
        "pp4tp4>pp4tp2": 12 * s + Es / 2 + Hs / 2,
        # each old device keeps 4 layers x a quarter for the new stage inside its old stage
        "pp4tp2>pp6tp4": 16 * s + 64 * r + Es / 2 + 2 * Er + Hs / 2 + 2 * Hr,
        # each new rank finds 4 of its 6 layers, a quarter of its half, on one old device
        "pp6tp4>pp4tp2": 16 * s + 16 * r + Es / 2 + Hs / 2,
        # six old devices per stage each keep one eighth; two new ranks per stage start empty
        "pp4tp2dp3>pp4tp8dp1": 6 * s + 48 * r + Es / 4 + 2 * Er + Hs / 4 + 2 * Hr,
    }[row]


def eight_gpu_nodes(row: str, s, r, Es, Er, Hs, Hr):  # noqa: N803
    return {
        # node 0 holds the old layout but fits two TP-4 groups: stages 0 and 3 (with embedding and head)
        "pp4tp2>pp4tp4": 18 * s + 72 * r + Es / 2 + 2 * Er + Hs / 2 + 2 * Hr,
        # shrink to the pinned node 0 (old stages 0, 1): stages 0 and 1 as on one node, 2 and 3 start empty
        "pp4tp4>pp4tp2": 18 * s + 24 * r + Es / 2 + Hs + 2 * Hr,
        # node 0 fits two of six TP-4 groups: the new first and last stages
        "pp4tp2>pp6tp4": 20 * s + 80 * r + Es / 2 + 2 * Er + Hs / 2 + 2 * Hr,
        # shrink to the pinned node 0 (old stages 0, 1): new stage 0 keeps 4 layers, stage 1 two
        "pp6tp4>pp4tp2": 21 * s + 36 * r + Es / 2 + Hs + 2 * Hr,
        # one TP-8 group per node: stage 0 on node 0 (six holders), stage 3 on node 2 (six), stage 1 or 2 on node 1 (four)
        "pp4tp2dp3>pp4tp8dp1": 12 * s + 96 * r + Es / 4 + 2 * Er + Hs / 4 + 2 * Hr,
    }[row]


ROWS = ["pp4tp2>pp4tp4", "pp4tp4>pp4tp2", "pp4tp2>pp6tp4", "pp6tp4>pp4tp2", "pp4tp2dp3>pp4tp8dp1"]


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("topology,formula", [(Topology.grid(1, 64), one_node),
                                              (Topology.grid(8, 8), eight_gpu_nodes)], ids=["64-gpu-node", "8-gpu-nodes"])
def test_paper_rows_move_the_closed_form_optimum(row, topology, formula):
    prev, curr = (ParallelConfig.parse(x) for x in row.split(">"))
    p = plan(MODEL, prev, curr, topology, placement="packed")
    expected = formula(row, **GPT.part_bytes())
    assert p.bytes_moved == expected
    assert p.optimal and p.bytes_lower_bound == p.bytes_moved
    assert p.bytes_lower_bound_no_rule <= p.bytes_lower_bound
    if formula is one_node:
        assert p.bytes_lower_bound_no_rule == p.bytes_moved  # no rule binds on one big node
