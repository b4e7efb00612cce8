"""Virtual rank allocator (paper III-E): which physical device each new virtual rank runs on.

The rule (paper: efficiency defragmentation) is that a TP group lives inside one node, on any
subset of its GPUs; with NVLink islands declared (`Topology.tp_domain`) inside one island.
Occupancy comes first: a shrink keeps the fewest whole nodes (pinned nodes always kept); then
the fewest bytes. With `placement="resilient"` and DP >= 2 no node holds every replica of a
PP stage, so the loss of any one node leaves a full replica.

Bytes are given as `retained[new class, device kind]`: what a device of that kind already holds
of what a rank of that class needs. The placement is found in two steps:

1. A greedy pass fills each node's TP-group slots with the stages that gain most there (the
   inner assignment of group members to a node's devices is an exact small assignment
   problem, memoised by the node's kinds), then places the rest where slots are left.
2. Certificate: `upper_bound` is the retained bytes of the best assignment of ranks to
   devices with no node rule at all (a transportation problem). When the greedy placement
   retains that much and keeps the fewest nodes, it is optimal. Otherwise an exact integer
   program decides (`scipy.optimize.milp`): per node island, x[class, kind] ranks of a class
   on devices of a kind that hold part of its state, g[stage] TP groups, u[node] node kept.
   A node island holding g groups can seat its members on any of its devices, so the ranks
   not counted in x sit on the island's other devices at zero gain: every (x, g, u) is a
   placement and every placement gives one, so the program's optimum is the optimum.
   Every state move is then one hop to its final device.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from migrate.layout import LayoutError, ParallelConfig
from migrate.pairing import assign_kinds
from migrate.topology import Topology

PLACEMENTS = ("packed", "resilient")
# The exact program is used up to this many variables; larger problems keep the greedy placement.
MILP_VARIABLE_LIMIT = 20000
MILP_TIME_LIMIT_S = 10.0
# A domain's best mix of groups is enumerated up to this many mixes (else a looser bound is used).
PATTERN_LIMIT = 4096


@dataclass(frozen=True)
class Placement:
    devices: tuple[int, ...]  # new virtual rank -> device id
    notes: tuple[str, ...]
    retained: int  # bytes the new ranks find already on their devices
    upper_bound: int  # the most any placement could retain (no node rule)
    rule_bound: int  # the most any placement under the rules retains (proven bound; == retained when optimal)
    optimal: bool  # proven: no placement under the rules retains more


@dataclass
class _Domain:
    node: int  # index into the node list
    devices: list[int]  # alive device ids
    sig: tuple[int, ...]  # kinds of those devices, in order

    @property
    def size(self) -> int:
        return len(self.devices)


class Allocator:
    """Places the ranks of `curr` on devices; `retained[class, kind]` in bytes (see module docstring)."""

    def __init__(self, curr: ParallelConfig, retained: np.ndarray, device_kind: dict[int, int],
                 topology: Topology, tp_in_node: bool = True, placement: str = "packed") -> None:
        if placement not in PLACEMENTS:
            raise LayoutError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.curr, self.w, self.kind, self.topo = curr, np.asarray(retained, dtype=np.int64), device_kind, topology
        self.tp_in_node, self.placement = tp_in_node, placement
        self.notes: list[str] = []
        self._inner: dict[tuple, tuple[int, np.ndarray]] = {}
        self._relevant: dict[tuple[int, ...], list[int]] = {}
        self._potential: dict[tuple[int, ...], int] = {}
        self._cheap: int | None = None
        self._upper: int | None = None

    # -- setup ---------------------------------------------------------------------------------
    def place(self) -> Placement:
        m = self.curr.world_size
        alive = sorted(self.kind)
        if len(alive) < m:
            raise LayoutError(f"{self.curr} needs {m} devices but only {len(alive)} are available")
        size = self.curr.tp if self.tp_in_node else 1
        domains = self._domains(size)
        if size > 1 and sum(d.size // size for d in domains) < self.curr.groups * self.curr.dp:
            self.notes.append(f"no node has room for {self.curr.groups * self.curr.dp} TP groups of {size} inside "
                              "one node: TP groups span nodes")
            size, domains = 1, self._domains(1)
        # unit types: one per TP group of a replica (a PP stage's, or its FSDP rank's), or per class when
        # groups may span nodes
        t = self.curr.tp
        units = ([list(range(g * t, g * t + t)) for g in range(self.curr.groups)] if size > 1
                 else [[c] for c in range(self.curr.classes)])
        resilient = self.placement == "resilient" and self.curr.dp >= 2
        solver = _Solver(self, units, domains, size, resilient)
        counts, optimal = solver.solve()
        if counts is None and resilient:
            self.notes.append("no placement keeps a replica of every stage off each node "
                              f"({len(solver.nodes)} node(s)): placed packed, a node loss loses state")
            solver = _Solver(self, units, domains, size, False)
            counts, optimal = solver.solve()
        if counts is None:
            raise LayoutError(f"no placement of {self.curr} found within {MILP_TIME_LIMIT_S:.0f} s")
        devices, retained = self._realise(units, domains, counts)
        if not optimal:
            self.notes.append("placement not proven optimal (problem too large for the exact program)")
        bound = retained if optimal else max(retained, solver.bound)
        return Placement(devices, tuple(dict.fromkeys(self.notes)), retained, self.relaxation(), bound, optimal)

    def _domains(self, size: int) -> list[_Domain]:
        out = []
        kind = self.kind
        for n, node in enumerate(self.topo.nodes):
            for island in self.topo.islands(node, size):
                pairs = sorted((kind[d], d) for d in island if d in kind)
                if pairs:
                    out.append(_Domain(n, [d for _k, d in pairs], tuple(k for k, _d in pairs)))
        return out

    def cheap_bound(self) -> int:
        """An upper bound on retained bytes in O(devices): every rank at its best kind, or the best devices."""
        if self._cheap is None:
            kinds = np.fromiter(self.kind.values(), dtype=np.int64)
            rank_best = int(self.w[:, np.unique(kinds)].max(axis=1).sum()) * self.curr.dp
            per_device = self.w.max(axis=0)[kinds]
            m = self.curr.world_size
            if m < len(per_device):
                per_device = np.partition(per_device, len(per_device) - m)[len(per_device) - m:]
            self._cheap = min(rank_best, int(per_device.sum()))
        return self._cheap

    def relaxation(self, known: int | None = None) -> int:
        """Most bytes any placement retains: every rank on any device, no node rule (transportation).

        `known`: a placement that retains `cheap_bound()` proves the relaxation equals it."""
        if known is not None:
            self._upper = known
        if self._upper is None:
            self._upper = self._transport_bound()
        return self._upper

    def _transport_bound(self) -> int:
        kinds = np.array(sorted(self.kind.values()), dtype=np.int64)
        uniq, mult = np.unique(kinds, return_counts=True)
        classes = self.w.shape[0]
        cost = -self.w[:, uniq]
        counts = assign_kinds(cost - cost.min(), [self.curr.dp] * classes, mult.tolist())
        return int(sum(self.w[r, uniq[c]] * n for (r, c), n in counts.items()))

    def potential(self, sig: tuple[int, ...]) -> int:
        """What a domain's devices could retain at most, each for its best class."""
        out = self._potential.get(sig)
        if out is None:
            out = self._potential[sig] = int(self.w[:, list(sig)].max(axis=0).sum())
        return out

    # -- one island: the exact inner assignment --------------------------------------------------
    def relevant(self, sig: tuple[int, ...], units: list[list[int]]) -> list[int]:
        """Unit types that retain something on a domain with kinds `sig`."""
        out = self._relevant.get(sig)
        if out is None:
            gain = self.w[:, list(sig)].max(axis=1) > 0
            out = [i for i, members in enumerate(units) if gain[members].any()]
            self._relevant[sig] = out
        return out

    def inner(self, sig: tuple[int, ...], units: list[list[int]], counts: tuple[tuple[int, int], ...]
              ) -> tuple[int, np.ndarray]:
        """Best retained bytes of `counts` ((unit type, groups), sorted) on a domain, and row -> device position."""
        key = (sig, counts)
        memo = self._inner.get(key)
        if memo is None:
            rows = [c for i, n in counts for _ in range(n) for c in units[i]]
            if not rows:
                memo = (0, np.zeros(0, dtype=np.int64))
            else:
                from scipy.optimize import linear_sum_assignment  # here, not at import (migrate.pairing says why)

                sub = self.w[np.ix_(rows, list(sig))]
                ri, ci = linear_sum_assignment(sub, maximize=True)
                perm = np.empty(len(rows), dtype=np.int64)
                perm[ri] = ci
                memo = (int(sub[ri, ci].sum()), perm)
            self._inner[key] = memo
        return memo

    def _realise(self, units: list[list[int]], domains: list[_Domain], counts: list[dict[int, int]]
                 ) -> tuple[tuple[int, ...], int]:
        """Rank -> device from the groups of each unit type per domain."""
        cur = self.curr
        placement = [-1] * cur.world_size
        next_copy = [0] * len(units)
        retained = 0
        for dom, cnt in zip(domains, counts):
            if not cnt:
                continue
            key = tuple(sorted(cnt.items()))
            value, perm = self.inner(dom.sig, units, key)
            retained += value
            row = 0
            for i, n in key:
                for _ in range(n):
                    copy = next_copy[i]
                    next_copy[i] += 1
                    for c in units[i]:  # the copy-th group of a unit type (or copy of a class) is DP replica copy
                        placement[cur.class_rank(c, copy)] = dom.devices[perm[row]]
                        row += 1
        return tuple(placement), retained


class _Solver:
    """Groups per domain: greedy with a certificate, else the exact program."""

    def __init__(self, a: Allocator, units: list[list[int]], domains: list[_Domain], size: int,
                 resilient: bool) -> None:
        self.a, self.units, self.domains, self.size, self.resilient = a, units, domains, size, resilient
        self.dp = a.curr.dp
        self.limit = self.dp - 1 if resilient else self.dp  # groups of one unit type per node
        node_names = a.topo.nodes
        used_nodes = sorted({d.node for d in domains})
        self.nodes = used_nodes
        self.pinned = {n for n in used_nodes if node_names[n] in a.topo.pinned}
        self.cap = {n: 0 for n in used_nodes}
        for d in domains:
            self.cap[d.node] += d.size // size
        need = len(units) * self.dp
        # fewest nodes: pinned ones, then the largest
        have, k = 0, 0
        for n in sorted(used_nodes, key=lambda n: (n not in self.pinned, -self.cap[n], n)):
            if have >= need and n not in self.pinned:
                break
            have += self.cap[n]
            k += 1
        self.k_min = max(k, 2 if resilient else 1)

    def nodes_used(self, counts: list[dict[int, int]]) -> int:
        return len({d.node for d, c in zip(self.domains, counts) if c} | self.pinned)

    def node_bound(self) -> int:
        """Most any placement on at most k_min nodes retains: each node at its own best, the best nodes kept."""
        best: dict[int, int] = {n: 0 for n in self.nodes}
        for d in self.domains:
            best[d.node] += self._domain_best(d.sig, d.size // self.size)
        pinned = sum(best[n] for n in self.pinned)
        rest = sorted((best[n] for n in self.nodes if n not in self.pinned), reverse=True)
        return pinned + sum(rest[:max(0, self.k_min - len(self.pinned))])

    def _domain_best(self, sig: tuple[int, ...], cap: int) -> int:
        """The most one domain can retain with any mix of at most `cap` groups (exact when few mixes exist)."""
        cands = self.a.relevant(sig, self.units)
        top = min(cap, self.limit)
        mixes = 1
        for _ in cands:
            mixes *= top + 1
            if mixes > PATTERN_LIMIT:
                return self.a.potential(sig)  # every device at its best class
        best = 0

        def walk(pos: int, left: int, mix: tuple[tuple[int, int], ...]) -> None:
            nonlocal best
            if pos == len(cands):
                if mix:
                    best = max(best, self.a.inner(sig, self.units, mix)[0])
                return
            for n in range(min(top, left) + 1):
                walk(pos + 1, left - n, mix + ((cands[pos], n),) if n else mix)

        walk(0, cap, ())
        return best

    def solve(self) -> tuple[list[dict[int, int]] | None, bool]:
        counts = self._greedy()
        cheap = self.a.cheap_bound()
        self.bound = cheap
        if counts is not None:
            value = sum(self.a.inner(d.sig, self.units, tuple(sorted(c.items())))[0]
                        for d, c in zip(self.domains, counts) if c)
            if value == cheap and self.nodes_used(counts) <= self.k_min:
                self.a.relaxation(known=cheap)
                return counts, True
            upper = self.bound = self.a.relaxation()
            if value < upper and self.nodes_used(counts) <= self.k_min:
                self.bound = min(upper, self.node_bound())
            if value == self.bound and self.nodes_used(counts) <= self.k_min:
                return counts, True
        n_vars = self._variable_count()
        if n_vars > MILP_VARIABLE_LIMIT:
            return counts, False
        for k in range(self.k_min, len(self.nodes) + 1):
            exact, status = self._milp(k)
            if status == 0:
                return exact, True
            if status != 2:  # out of time: the greedy placement if there is one, else what the program found
                return (counts if counts is not None else exact), False
        return None, False

    # -- greedy ---------------------------------------------------------------------------------
    def _greedy(self) -> list[dict[int, int]] | None:
        a, units, size = self.a, self.units, self.size
        left = [self.dp] * len(units)
        counts: list[dict[int, int]] = [{} for _ in self.domains]
        per_node: dict[tuple[int, int], int] = {}
        values = [0] * len(self.domains)
        by_node: dict[int, list[int]] = {}
        for j, d in enumerate(self.domains):
            by_node.setdefault(d.node, []).append(j)
        potential = {n: sum(a.potential(self.domains[j].sig) for j in js) for n, js in by_node.items()}
        order = sorted(self.nodes, key=lambda n: (n not in self.pinned, -potential[n], n))
        opened: set[int] = set(self.pinned)
        need = len(units) * self.dp

        closed = Counter(self.cap[m] for m in self.nodes if m not in opened)  # caps of nodes not opened
        have = [sum(self.cap[m] for m in opened)]

        def room(n: int) -> bool:
            """May node n be opened and still leave room for every group on at most k_min nodes?"""
            if n in opened:
                return True
            slots = self.k_min - len(opened) - 1
            if slots < 0:
                return False
            total, skip = have[0] + self.cap[n], self.cap[n]  # n itself is not among the rest
            for c in sorted(closed, reverse=True):
                take = closed[c] - (1 if c == skip else 0)
                take = min(take, slots)
                total += take * c
                slots -= take
                if slots == 0 or total >= need:
                    break
            return total >= need

        def add(j: int, i: int) -> None:
            n = self.domains[j].node
            counts[j][i] = counts[j].get(i, 0) + 1
            left[i] -= 1
            per_node[(n, i)] = per_node.get((n, i), 0) + 1
            if n not in opened:
                opened.add(n)
                closed[self.cap[n]] -= 1
                have[0] += self.cap[n]

        # 1: positive gains, best first, on nodes in order of what they hold
        for n in order:
            for j in by_node[n]:
                d = self.domains[j]
                cands = a.relevant(d.sig, units)
                while cands and sum(counts[j].values()) < d.size // size and room(n):
                    best, best_gain = -1, 0
                    for i in cands:
                        if left[i] <= 0 or per_node.get((n, i), 0) >= self.limit:
                            continue
                        trial = dict(counts[j])
                        trial[i] = trial.get(i, 0) + 1
                        gain = a.inner(d.sig, units, tuple(sorted(trial.items())))[0] - values[j]
                        if gain > best_gain:
                            best, best_gain = i, gain
                    if best < 0:
                        break
                    add(j, best)
                    values[j] += best_gain
        # 2: the rest wherever slots are free, opened nodes first, then the largest
        rest = sorted(self.nodes, key=lambda n: (n not in opened, -self.cap[n], n))
        for n in rest:
            for j in by_node[n]:
                d = self.domains[j]
                while sum(counts[j].values()) < d.size // size:
                    i = next((i for i in range(len(units)) if left[i] > 0 and per_node.get((n, i), 0) < self.limit),
                             None)
                    if i is None:
                        break
                    add(j, i)
            if not any(x > 0 for x in left):
                break
        return counts if not any(x > 0 for x in left) else None

    # -- the exact program ------------------------------------------------------------------------
    def _x_vars(self) -> list[tuple[int, int, int, int]]:
        """(domain, unit type, class, kind) with something retained."""
        out = []
        for j, d in enumerate(self.domains):
            kinds = sorted(set(d.sig))
            for i in self.a.relevant(d.sig, self.units):
                for c in self.units[i]:
                    for k in kinds:
                        if self.a.w[c, k] > 0:
                            out.append((j, i, c, k))
        return out

    def _variable_count(self) -> int:
        return len(self.domains) * len(self.units) + len(self.nodes) + sum(
            len(self.a.relevant(d.sig, self.units)) * len(self.units[0]) * len(set(d.sig)) for d in self.domains)

    def _milp(self, k: int) -> tuple[list[dict[int, int]] | None, int]:
        """Groups per domain on at most k nodes, and HiGHS's status (0 optimal, 2 infeasible, 1 out of time)."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        w, units, doms, size = self.a.w, self.units, self.domains, self.size
        xs = self._x_vars()
        g0 = len(xs)
        g_index = {(j, i): g0 + j * len(units) + i for j in range(len(doms)) for i in range(len(units))}
        u0 = g0 + len(doms) * len(units)
        u_index = {n: u0 + q for q, n in enumerate(self.nodes)}
        nv = u0 + len(self.nodes)
        cost = np.zeros(nv)
        lb, ub = np.zeros(nv), np.zeros(nv)
        rows, cols, vals, lo, hi = [], [], [], [], []
        r = 0

        def row(entries: list[tuple[int, float]], low: float, high: float) -> None:
            nonlocal r
            for col, v in entries:
                rows.append(r)
                cols.append(col)
                vals.append(v)
            lo.append(low)
            hi.append(high)
            r += 1

        kind_count = [dict(zip(*np.unique(d.sig, return_counts=True))) for d in doms]
        for v, (j, i, c, kk) in enumerate(xs):
            cost[v] = -float(w[c, kk])
            ub[v] = kind_count[j][kk]
        for (j, i), v in g_index.items():
            ub[v] = min(doms[j].size // size, self.limit)
        for n, v in u_index.items():
            lb[v], ub[v] = (1, 1) if n in self.pinned else (0, 1)
        # every unit type has dp groups
        for i in range(len(units)):
            row([(g_index[j, i], 1.0) for j in range(len(doms))], self.dp, self.dp)
        # x of a class on a domain <= groups of its unit type there
        by_jc: dict[tuple[int, int, int], list[int]] = {}
        by_jk: dict[tuple[int, int], list[int]] = {}
        for v, (j, i, c, kk) in enumerate(xs):
            by_jc.setdefault((j, i, c), []).append(v)
            by_jk.setdefault((j, kk), []).append(v)
        for (j, i, c), vs in by_jc.items():
            row([(v, 1.0) for v in vs] + [(g_index[j, i], -1.0)], -np.inf, 0)
        for (j, kk), vs in by_jk.items():
            row([(v, 1.0) for v in vs], -np.inf, kind_count[j][kk])
        # groups fit the domain, and only on kept nodes
        for j, d in enumerate(doms):
            row([(g_index[j, i], float(size)) for i in range(len(units))] + [(u_index[d.node], -float(d.size))],
                -np.inf, 0)
        row([(v, 1.0) for v in u_index.values()], -np.inf, k)
        if self.resilient:
            by_node: dict[int, list[int]] = {}
            for j, d in enumerate(doms):
                by_node.setdefault(d.node, []).append(j)
            for n, js in by_node.items():
                if len(js) > 1:
                    for i in range(len(units)):
                        row([(g_index[j, i], 1.0) for j in js], -np.inf, self.limit)
        a_mat = coo_matrix((vals, (rows, cols)), shape=(r, nv)).tocsr()
        res = milp(cost, constraints=LinearConstraint(a_mat, lo, hi), integrality=np.ones(nv),
                   bounds=Bounds(lb, ub), options={"time_limit": MILP_TIME_LIMIT_S})
        if res.x is None:
            return None, res.status  # 2: proven infeasible; else out of time with nothing found
        x = np.rint(res.x).astype(np.int64)
        return [{i: int(x[g_index[j, i]]) for i in range(len(units)) if x[g_index[j, i]] > 0}
                for j in range(len(doms))], res.status


def initial_placement(layout: ParallelConfig, topology: Topology, placement: str = "resilient",
                      tp_in_node: bool = True) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Devices for a layout's first start (no state yet) under the same rules: fewest nodes, TP
    groups inside a node, and with `resilient` the DP replicas of each stage on different nodes.

    Returns (device of each virtual rank, notes).
    """
    kinds = {d.id: 0 for d in topology.devices}
    retained = np.zeros((layout.classes, 1), dtype=np.int64)
    p = Allocator(layout, retained, kinds, topology, tp_in_node, placement).place()
    return p.devices, p.notes


def survives_node_loss(layout: ParallelConfig, devices: Sequence[int], topology: Topology) -> bool:
    """True when losing any one node leaves a copy of every (pp stage, fsdp rank, tp rank) class."""
    nodes: dict[int, set[str]] = {}
    for r, dev in enumerate(devices):
        nodes.setdefault(layout.class_of(r), set()).add(topology.devices[dev].node)
    return all(len(v) >= 2 for v in nodes.values())
