"""Pure functions that turn a rank map into the placement grid and a fragmentation summary.

They live in `db` (not the dashboard) because the launcher needs the same fragmentation
numbers for `start_migration(fragmentation_before=...)` and `finish_migration(...after)`.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from db.records import RankEntry


class NodeInfo(NamedTuple):
    """What the grid needs of a node besides its ranks. gpus 0: the job's gpus_per_node (older rows)."""

    name: str
    state: str
    pinned: bool
    gpus: int = 0
    component: int = 0


def _infos(nodes: Sequence[tuple], entries: Sequence[RankEntry]) -> list[NodeInfo]:
    """The nodes in order, then nodes only the rank map names (they take their ranks' component)."""
    known = [NodeInfo(*n) for n in nodes]
    names = {n.name for n in known}
    comp = {e.node: e.component for e in entries}
    return known + [NodeInfo(n, "active", False, 0, comp[n]) for n in sorted(set(comp) - names)]


def _width(node: NodeInfo, gpus_per_node: int, entries: Sequence[RankEntry]) -> int:
    """GPUs drawn for `node`: its own count (uneven nodes), never fewer than its ranks need."""
    return max([node.gpus or gpus_per_node] + [e.gpu + 1 for e in entries if e.node == node.name])


def tp_groups(entries: Iterable[RankEntry]) -> dict[tuple[int, int], list[RankEntry]]:
    """Tensor-parallel groups: ranks sharing (pp, dp), ordered by tp coordinate."""
    groups: dict[tuple[int, int], list[RankEntry]] = defaultdict(list)
    for e in entries:
        groups[(e.pp, e.dp)].append(e)
    return {k: sorted(v, key=lambda e: e.tp) for k, v in sorted(groups.items())}


def fragmentation(
    entries: Sequence[RankEntry],
    nodes: Sequence[NodeInfo],
    gpus_per_node: int,
    others: Mapping[tuple[str, int], str] | None = None,
) -> dict[str, Any]:
    """Per node occupied/idle devices, nodes that cannot be released, TP groups spanning nodes.

    `others` maps (node, gpu) to another job holding that device: such devices count as
    `other`, not idle.

    A node is releasable when no rank runs on it and it is not pinned. `unreleasable` lists
    nodes that hold idle devices yet cannot be handed back (pinned, or stranded by a few
    ranks): that is the capacity fragmentation costs.
    """
    used: dict[str, int] = defaultdict(int)
    for e in entries:
        used[e.node] += 1
    rows: list[dict[str, Any]] = []
    for node in _infos(nodes, entries):
        name, state, pinned = node.name, node.state, node.pinned
        if state in ("released", "failed") and not used[name]:
            continue
        occupied = used[name]
        other = sum(1 for (n, _g) in (others or {}) if n == name)
        idle = max((node.gpus or gpus_per_node) - occupied - other, 0)
        releasable = occupied == 0 and not pinned
        reason = "pinned" if pinned else ("in use" if occupied else "")
        rows.append({"node": name, "occupied": occupied, "other": other, "idle": idle, "pinned": pinned,
                     "releasable": releasable, "reason": reason})
    spanning = []
    for (pp, dp), group in tp_groups(entries).items():
        group_nodes = sorted({e.node for e in group})
        if len(group_nodes) > 1:
            spanning.append({"pp": pp, "dp": dp, "nodes": group_nodes, "ranks": [e.virtual_rank for e in group]})
    return {
        "nodes": rows,
        "occupied_devices": sum(r["occupied"] for r in rows),
        "idle_devices": sum(r["idle"] for r in rows),
        "unreleasable": [r["node"] for r in rows if r["idle"] and not r["releasable"]],
        "tp_groups_spanning_nodes": spanning,
    }


def grid(
    entries: Sequence[RankEntry],
    nodes: Sequence[NodeInfo],
    gpus_per_node: int,
    others: Mapping[tuple[str, int], str],
    failed: Iterable[tuple[str, int]] = (),
) -> list[dict[str, Any]]:
    """Rows of cells (one per GPU the node has: uneven nodes give rows of different lengths) saying
    what occupies each device, with the node's heterogeneous-job component.

    Cell kinds: rank (this job; with pp/dp/tp and its TP group), other (another job's rank),
    failed, idle. TP groups are numbered so the template can outline each with one colour.
    """
    by_device = {(e.node, e.gpu): e for e in entries}
    groups = tp_groups(entries)
    group_index = {key: i for i, key in enumerate(groups)}
    group_spans = {key: len({e.node for e in g}) > 1 for key, g in groups.items()}
    failed_set = set(failed)
    rows = []
    for node in _infos(nodes, entries):
        name, state = node.name, node.state
        cells: list[dict[str, Any]] = []
        for gpu in range(_width(node, gpus_per_node, entries)):
            e = by_device.get((name, gpu))
            if e is not None:
                key = (e.pp, e.dp)
                cells.append({"gpu": gpu, "kind": "rank", "rank": e.virtual_rank, "pp": e.pp, "dp": e.dp,
                              "tp": e.tp, "tp_group": group_index[key], "tp_spans_nodes": group_spans[key]})
            elif (name, gpu) in others:
                cells.append({"gpu": gpu, "kind": "other", "other_job": others[(name, gpu)]})
            elif (name, gpu) in failed_set or state == "failed":
                cells.append({"gpu": gpu, "kind": "failed"})
            else:
                cells.append({"gpu": gpu, "kind": "idle"})
        rows.append({"name": name, "state": state, "pinned": node.pinned, "component": node.component,
                     "cells": cells})
    return rows
