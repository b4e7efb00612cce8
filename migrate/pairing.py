"""Pairing new ranks with old devices: the assignment problem of paper Algorithm 1.

Ranks of the same class (same PP stage and TP rank, any DP replica) and devices holding the
same state are interchangeable, so the problem is solved on *kinds* with multiplicities. When
every multiplicity shares a factor g (the usual DP case) the problem is scaled down by g
before the Hungarian algorithm runs: its optimum times g is the optimum of the full problem,
because the transportation polytope scales with its supplies and demands and has integral
vertices. That is what keeps 16,384 devices under a second.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# scipy is imported where a problem is solved, not here: the training workers import this package
# (migrate.train, migrate.reshard) but never solve one, and scipy.optimize costs each of them ~0.5 s of
# CPU at start-up (tests/launcher/test_cli_startup.py checks they do not load it)

# Above this many expanded rows the Hungarian algorithm is replaced by a transportation LP.
HUNGARIAN_LIMIT = 2048


def solve_cost_matrix(cost: np.ndarray) -> list[tuple[int, int]]:
    """Paper Algorithm 1: pad C (M x N) to square with zeros, solve, drop pairs that touch padding."""
    from scipy.optimize import linear_sum_assignment

    m, n = cost.shape
    k = max(m, n)
    padded = np.zeros((k, k), dtype=cost.dtype)
    padded[:m, :n] = cost
    rows, cols = linear_sum_assignment(padded)
    return [(int(i), int(j)) for i, j in zip(rows, cols) if i < m and j < n]


def assign_kinds(cost: np.ndarray, row_mult: Sequence[int], col_mult: Sequence[int]) -> dict[tuple[int, int], int]:
    """Least-cost assignment of every row unit to a distinct column unit.

    cost[r, c] is the cost of one unit of row kind r on one unit of column kind c; there are
    row_mult[r] units of row kind r and col_mult[c] of column kind c. Returns how many units
    of each row kind go to each column kind.
    """
    row_mult, col_mult = np.asarray(row_mult, dtype=np.int64), np.asarray(col_mult, dtype=np.int64)
    if row_mult.sum() > col_mult.sum():
        raise ValueError(f"{row_mult.sum()} ranks cannot be placed on {col_mult.sum()} devices")
    nonzero = [int(x) for x in np.concatenate([row_mult, col_mult]) if x > 0]
    g = math.gcd(*nonzero) if nonzero else 1
    rows = np.repeat(np.arange(len(row_mult)), row_mult // g)
    cols = np.repeat(np.arange(len(col_mult)), col_mult // g)
    out: dict[tuple[int, int], int] = {}
    if len(rows) == 0:
        return out
    if len(rows) <= HUNGARIAN_LIMIT:
        from scipy.optimize import linear_sum_assignment

        ri, ci = linear_sum_assignment(cost[np.ix_(rows, cols)])
        for i, j in zip(ri, ci):
            key = (int(rows[i]), int(cols[j]))
            out[key] = out.get(key, 0) + g
        return out
    return _transport(cost, row_mult, col_mult)


def _transport(cost: np.ndarray, row_mult: np.ndarray, col_mult: np.ndarray) -> dict[tuple[int, int], int]:
    """The same problem as a transportation LP; HiGHS returns a vertex, which is integral."""
    from scipy.optimize import linprog

    r, c = cost.shape
    a_eq = np.zeros((r, r * c))
    a_ub = np.zeros((c, r * c))
    for i in range(r):
        a_eq[i, i * c:(i + 1) * c] = 1
    for j in range(c):
        a_ub[j, j::c] = 1
    res = linprog(cost.ravel().astype(float), A_ub=a_ub, b_ub=col_mult, A_eq=a_eq, b_eq=row_mult,
                  bounds=(0, None), method="highs")
    if not res.success:  # pragma: no cover - feasibility is checked above
        raise ValueError(f"placement problem has no solution: {res.message}")
    x = np.rint(res.x).astype(np.int64).reshape(r, c)
    return {(int(i), int(j)): int(x[i, j]) for i, j in zip(*np.nonzero(x))}
