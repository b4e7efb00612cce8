"""The paper's worked examples (ETC Fig. 4 and Fig. 5), in its item units."""
import numpy as np

from migrate.layout import ParallelConfig
from migrate.pairing import solve_cost_matrix
from migrate.workload import ByteModel, class_workloads, slice_units


def item_cost(prev: str, curr: str, layers: int) -> np.ndarray:
    p, c = ParallelConfig.parse(prev), ParallelConfig.parse(curr)
    g = slice_units(p.tp, c.tp)
    return ByteModel.items(g).cost(class_workloads(c, layers, g), class_workloads(p, layers, g))


def test_fig4_pp4_to_pp2_cost_matrix_and_pairs():
    cost = item_cost("pp4", "pp2", 16)
    assert cost.tolist() == [[4, 4, 8, 8], [8, 8, 4, 4]]
    pairs = solve_cost_matrix(cost)
    assert pairs == [(0, 0), (1, 2)]  # <C:0, P:0>, <C:1, P:2>
    assert sum(cost[i, j] for i, j in pairs) == 8  # keeping rank i as rank i would move 12


def test_fig5_pp_and_tp_matrices():
    assert item_cost("pp4", "pp6", 24).tolist() == [
        [0, 4, 4, 4], [2, 2, 4, 4], [4, 0, 4, 4], [4, 4, 0, 4], [4, 4, 2, 2], [4, 4, 4, 0]]
    assert item_cost("tp2", "tp4", 1).tolist() == [[0, 1], [0, 1], [1, 0], [1, 0]]


def test_fig5_merged_matrix_rows_and_pairs():
    cost = item_cost("pp4tp2", "pp6tp4", 24)  # rows P0T0..P5T3, columns P0T0..P3T1
    assert cost.shape == (24, 8)
    assert cost[0].tolist() == [0, 4, 4, 4, 4, 4, 4, 4]  # P0T0
    assert cost[1].tolist() == [0, 4, 4, 4, 4, 4, 4, 4]  # P0T1
    assert cost[2].tolist() == [4, 0, 4, 4, 4, 4, 4, 4]  # P0T2
    assert cost[3].tolist() == [4, 0, 4, 4, 4, 4, 4, 4]  # P0T3
    assert cost[4].tolist() == [2, 4, 2, 4, 4, 4, 4, 4]  # P1T0: layers 4-5 on old P0, 6-7 on old P1
    pairs = solve_cost_matrix(cost)
    assert len(pairs) == 8 and sorted(j for _, j in pairs) == list(range(8))
    # every old rank is reused by a new rank that already holds all it needs
    assert sum(cost[i, j] for i, j in pairs) == 0
    assert {(i, j) for i, j in pairs} <= {(i, j) for i in range(24) for j in range(8) if cost[i, j] == 0}
