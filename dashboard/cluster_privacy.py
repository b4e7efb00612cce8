"""/cluster as a user sees it where the site keeps jobs private (`--private-jobs`, Slurm's PrivateData=jobs).

Why: the cluster view is built from Slurm's whole queue, read as the dashboard's own user, who sees every job.
A user who may not see other users' jobs in lists, pages and history must not find them on the GPU grid either:
there a GPU of another user's job is only taken ("other"), with no job id, name, user or layout, as `sinfo`
shows a node allocated without saying to whom. The node states and the fragmentation figures, which are
counts, stay. Pure: no I/O.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from dashboard.cluster import ClusterView, GpuCell, NodeView


def _hidden(cell: GpuCell, user: str) -> bool:
    return cell.kind != "idle" and cell.user != user


def _node_for(node: NodeView, user: str, seen_names: set[str]) -> NodeView:
    gpus = tuple(GpuCell(c.index, "other") if _hidden(c, user) else c for c in node.gpus)
    components = tuple((name, c) for name, c in node.components if name in seen_names)
    return replace(node, gpus=gpus, components=components)


def view_for(view: ClusterView, user: str, own_jobs: set[int]) -> ClusterView:
    """`view` with every GPU of a job not `user`'s shown as "other", and the legend, the Slurm holders of
    elastic jobs and the shrink gains narrowed to `user`'s own (`own_jobs`: their elastic job ids)."""
    seen = [c for n in view.nodes for c in n.gpus if c.kind != "idle" and not _hidden(c, user)]
    seen_names = {c.job_name for c in seen}
    keys = {c.job for c in seen}
    return ClusterView(view.source, tuple(_node_for(n, user, seen_names) for n in view.nodes), view.fragmentation,
                       tuple(s for s in view.shrink if s.job_id in own_jobs),
                       {k: label for k, label in view.jobs.items() if k in keys},
                       {j: h for j, h in view.holders.items() if j in own_jobs})


def placement_for(placement: dict[str, Any], own_names: set[str]) -> dict[str, Any]:
    """A job page's placement (db.store.Store.placement) with another user's job on its nodes unnamed."""
    grid = [{**row, "cells": [{**c, "other_job": "another user's job"}
                              if c["kind"] == "other" and c["other_job"] not in own_names else c
                              for c in row["cells"]]}
            for row in placement["grid"]]
    return {**placement, "grid": grid}
