"""/cluster where the site keeps jobs private (dashboard.cluster_privacy): another user's GPUs are only taken,
the legend, Slurm holders and shrink gains are the viewer's own, the counts are the whole cluster's."""
from __future__ import annotations

from dashboard.cluster import ElasticJob, build_local
from dashboard.cluster_privacy import placement_for, view_for
from tests.db.seed import layout_entries


def _two_users_view():
    mine = ElasticJob(1, "llama", None, "pp2tp2dp1", 4, "n0", 1, tuple(layout_entries(2, 2, 1, ["n1"], 4)),
                      ("n0", "n1"), owner="alice")
    theirs = ElasticJob(2, "bert", None, "pp1tp2dp1", 4, None, 1,
                        tuple(layout_entries(1, 2, 1, ["n2"], 4, first_gpu=2)), ("n2",), owner="bob")
    return build_local([mine, theirs])


def test_another_users_gpus_are_taken_with_nothing_of_the_job_and_the_counts_stay() -> None:
    view = _two_users_view()
    seen = view_for(view, "alice", {1})
    n2 = seen.nodes[2]
    assert [(g.kind, g.job, g.job_name, g.elastic_id, g.layout, g.user) for g in n2.gpus] == \
        [("idle", "", "", None, "", "")] * 2 + [("other", "", "", None, "", "")] * 2
    assert seen.nodes[:2] == view.nodes[:2]  # her own job's nodes as they were
    assert seen.fragmentation == view.fragmentation and n2.stranded == 2  # counts, nobody's job
    assert list(seen.jobs) == ["job-1"] and [s.name for s in seen.shrink] == ["llama"]
    everyone = view_for(view, "carol", set())
    assert all(g.kind in ("idle", "other") for n in everyone.nodes for g in n.gpus) and not everyone.shrink


def test_a_job_page_names_only_the_viewers_own_jobs_on_its_nodes() -> None:
    placement = {"grid": [{"name": "n1", "cells": [{"gpu": 0, "kind": "rank"},
                                                   {"gpu": 1, "kind": "other", "other_job": "bert"},
                                                   {"gpu": 2, "kind": "other", "other_job": "gpt"}]}], "layout": "x"}
    out = placement_for(placement, {"gpt"})
    assert [c.get("other_job") for c in out["grid"][0]["cells"]] == [None, "another user's job", "gpt"]
    assert placement["grid"][0]["cells"][1]["other_job"] == "bert" and out["layout"] == "x"  # a copy
