"""Heterogeneous jobs on uneven nodes in the dashboard (issue 13 item 5): the placement grid of the job
page and /cluster draws one cell per GPU a node has and marks each node's het-job component.

The job is recorded through the real Store (tests.db.seed.seed_hetjob: 2 x 4-GPU nodes in component 0,
2 x 2-GPU nodes in component 1, the testbed's 4,4,2,2 shape); the expected widths are the node sizes
given to the store, never read back from the code under test.
"""
from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from dashboard.cluster import ElasticJob, build_from_slurm
from dashboard.slurm_reader import SlurmNode, SlurmSnapshot, parse_squeue
from db.records import RankEntry
from tests.db.seed import HET_NODES, seed_hetjob, uneven_entries

GOLDEN = Path(__file__).resolve().parents[1] / "launcher" / "golden"


class Rows(HTMLParser):
    """Every <tr data-node> of a page: its attributes, its GPU cells, and the text of its badges."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, Any]] = {}
        self._row: dict[str, Any] | None = None
        self._badge = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and "data-node" in a:
            self._row = {"attrs": a, "cells": 0, "badges": []}
            self.rows[a["data-node"]] = self._row
        elif self._row is not None and tag == "td" and "cell" in a.get("class", "").split():
            self._row["cells"] += 1
        elif self._row is not None and tag == "span" and "comp-badge" in a.get("class", "").split():
            self._badge = True
            self._row["badges"].append("")

    def handle_data(self, data: str) -> None:
        if self._badge and self._row is not None:
            self._row["badges"][-1] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "span":
            self._badge = False
        elif tag == "tr":
            self._row = None


def test_job_page_draws_each_node_as_wide_as_its_gpus_and_marks_components(viewer, store) -> None:
    job = seed_hetjob(store)
    for headers in ({}, {"HX-Request": "true"}):  # the page and the partial htmx swaps in
        html = viewer.get(f"/jobs/{job}", headers=headers).text
        rows = Rows(html).rows
        assert {n: r["cells"] for n, r in rows.items()} == {name: gpus for name, gpus, _ in HET_NODES}
        assert {n: r["attrs"]["data-component"] for n, r in rows.items()} == {
            name: str(comp) for name, _, comp in HET_NODES}
        assert {n: r["badges"] for n, r in rows.items()} == {
            name: [f"component {comp}"] for name, _, comp in HET_NODES}
        assert all(f"comp-{comp}" in rows[name]["attrs"]["class"].split() for name, _, comp in HET_NODES)
        assert html.count("<th>GPU ") == 4 and 'id="components"' in html  # columns of the widest node


def test_plain_job_page_shows_no_component_marks(viewer) -> None:
    html = viewer.get("/jobs/1").text  # llama: a plain job on equal nodes
    rows = Rows(html).rows
    assert rows and all(r["badges"] == [] and "data-component" not in r["attrs"] for r in rows.values())
    assert {r["cells"] for r in rows.values()} == {4} and 'id="components"' not in html


def test_cluster_page_on_the_local_backend_draws_uneven_nodes_with_components(admin, store) -> None:
    seed_hetjob(store)  # nodes a1, a2, b1, b2 besides the demo's n0..n2 (4 GPUs each)
    rows = Rows(admin.get("/cluster").text).rows
    for name, gpus, comp in HET_NODES:
        assert rows[name]["cells"] == gpus and rows[name]["attrs"]["data-gpus"] == str(gpus)
        assert rows[name]["attrs"]["data-components"] == f"het:{comp}"
        assert rows[name]["badges"] == [f"het · component {comp}"]
    assert rows["n1"]["cells"] == 4 and rows["n1"]["badges"] == [] and "data-components" not in rows["n1"]["attrs"]


def test_recorded_heterogeneous_squeue_marks_each_component() -> None:
    """squeue --json recorded on the testbed (job 19: component 0 on n1 with 4 GPUs, component 1 on n3, n4
    with 2 each): each Slurm record of the het job belongs to the elastic job, and the nodes carry the
    component Slurm says (het_job_offset)."""
    jobs = parse_squeue((GOLDEN / "hetjob_squeue.json").read_text())
    assert sorted((j.job_id, j.het_job_id, j.het_job_offset) for j in jobs) == [("19", "19", 0), ("20", "19", 1)]
    nodes = (("n1", 4, 0), ("n3", 2, 1), ("n4", 2, 1))
    snap = SlurmSnapshot(tuple(SlurmNode(n, ("gpu4" if g == 4 else "gpu2",), g, "mixed", (), "")
                               for n, g, _ in (("n1", 4, 0), ("n2", 4, 0), *nodes[1:])), tuple(jobs), ())
    entries = tuple(uneven_entries(1, 2, 4, nodes))
    job = ElasticJob(1, "het-exp", "19", "pp1tp2dp4", 4, "n1", 1, entries, ("n1", "n3", "n4"),
                     {n: g for n, g, _ in nodes}, {n: c for n, _, c in nodes})
    view = build_from_slurm(snap, [job])
    by = {n.name: n for n in view.nodes}
    assert {n: len(v.gpus) for n, v in by.items()} == {"n1": 4, "n2": 4, "n3": 2, "n4": 2}
    assert [g.kind for g in by["n3"].gpus] == ["elastic", "elastic"] and by["n4"].gpus[1].rank == 7
    assert {n: v.components for n, v in by.items()} == {
        "n1": (("het-exp", 0),), "n2": (), "n3": (("het-exp", 1),), "n4": (("het-exp", 1),)}


def test_rank_map_exports_name_each_ranks_component_node_and_gpu(viewer, anon, store) -> None:
    job = seed_hetjob(store)  # pp2tp2dp3 packed: ranks 0-3 on a1, 4-7 on a2 (component 0), 8-9 b1, 10-11 b2 (1)
    assert f'href="/jobs/{job}/rank-maps?format=csv"' in viewer.get(f"/jobs/{job}").text
    rows = viewer.get(f"/jobs/{job}/rank-maps").get_json()
    slots = [(name, gpu, comp) for name, gpus, comp in HET_NODES for gpu in range(gpus)]
    assert [(r["virtual_rank"], r["node"], r["gpu"], r["component"]) for r in rows] == [
        (rank, *slot) for rank, slot in enumerate(slots)]
    assert [(r["pp"], r["dp"], r["tp"]) for r in rows][9] == (1, 1, 1)  # rank 9 = (1 * 3 + 1) * 2 + 1
    csv = viewer.get(f"/jobs/{job}/rank-maps?format=csv")
    lines = csv.text.splitlines()
    assert csv.mimetype == "text/csv" and lines[0].startswith("job_id,epoch,layout,") and len(lines) == 13
    assert lines[11].endswith(",10,1,b2,0,1,2,0")  # rank 10: component 1, b2 GPU 0, pp1 dp2 tp0
    assert viewer.get(f"/jobs/{job}/rank-maps?format=xml").status_code == 400
    assert viewer.get("/jobs/999/rank-maps").status_code == 404
    assert anon.get(f"/jobs/{job}/rank-maps").status_code in (302, 401)


def test_preempt_dry_run_counts_each_nodes_own_gpus() -> None:
    """Preempting the 2-GPU node b2 of the 4,4,2,2 job leaves 4 + 4 + 2 = 10 devices (not 3 x 4): the dry
    run asks the job's recorded policy for 10 and plans on nodes of their own sizes."""
    from dashboard.preempt_preview import preview_job

    job = ElasticJob(1, "het", None, "pp2tp2dp3", 4, "a1", 1, tuple(uneven_entries(2, 2, 3)),
                     tuple(n for n, _, _ in HET_NODES), {n: g for n, g, _ in HET_NODES}, {n: c for n, _, c in HET_NODES})
    spec = {"model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256}, "layouts": {"10": "pp1tp2dp5", "12": "pp2tp2dp3"}}
    p = preview_job(job, spec, {"b2"}, lambda job, leaving: None)
    assert (p.refused, p.keep, p.to_layout, p.nodes_released) == ("", ("a1", "a2", "b1"), "pp1tp2dp5", ("b2",))
    assert p.bytes_moved and p.bytes_moved > 0


HET_SPEC = {"model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256},
            "layouts": {"8": "pp2tp2dp2", "10": "pp1tp2dp5", "12": "pp2tp2dp3"}}


def test_preempt_dry_run_shows_only_what_slurm_releases_from_a_heterogeneous_job() -> None:
    """The dry run against Slurm 22.05's rules as measured on the testbed (docs/reference/slurm.md, "Heterogeneous jobs"),
    expected values worked out by hand: on the 4,4,2,2 job (leader component a1 batch host, a2; component 1
    b1 its batch host, b2) a preempt of the leader's a2 moves the ranks off it but Slurm cannot resize the
    leader, so a2 stays allocated, idle, and nothing is released; b2 goes (component 1 shrinks); b1, its
    component's batch host, stays while b2 is kept; b1 and b2 together go (the component is cancelled)."""
    from dashboard.preempt_preview import preview_job

    job = ElasticJob(1, "het", None, "pp2tp2dp3", 4, "a1", 1, tuple(uneven_entries(2, 2, 3)),
                     tuple(n for n, _, _ in HET_NODES), {n: g for n, g, _ in HET_NODES}, {n: c for n, _, c in HET_NODES})
    expected = {("a2",): ((), ("a2",), "component 0: Slurm cannot resize a heterogeneous job's leader component"),
                ("b2",): (("b2",), (), "component 1: b2 released"),
                ("b1",): ((), ("b1",), "component 1: its batch host b1 goes only with the whole job"),
                ("b1", "b2"): (("b1", "b2"), (), "component 1 cancelled: b[1-2] released")}
    for picked, (released, stays, why) in expected.items():
        p = preview_job(job, HET_SPEC, set(picked), lambda job, leaving: None)
        assert (p.refused, p.leaving, p.nodes_released, p.stays) == ("", picked, released, stays), (picked, p)
        assert p.to_layout == HET_SPEC["layouts"][str(12 - sum(g for n, g, _ in HET_NODES if n in picked))]
        assert len(p.notes) == 1 and p.notes[0].startswith(why), (picked, p.notes)  # no Slurm id without Slurm


def test_preempt_dry_run_on_the_slurm_view_uses_the_components_slurm_lists() -> None:
    """On the Slurm view the holders are squeue's records: the guide's script (leader component 30 on n3, n4,
    batch host n3; component 1, job 31, on n1). Preempting n4 releases nothing (the leader cannot be resized);
    preempting n1 cancels component 1 and releases n1."""
    from dashboard.preempt_preview import preview
    from dashboard.slurm_reader import SlurmJob

    records = [("30", 0, "n3", {"n3": 2, "n4": 2}), ("31", 1, "n1", {"n1": 4})]
    sizes = {n: g for _, _, _, nodes in records for n, g in nodes.items()}
    comp = {n: off for _, off, _, nodes in records for n in nodes}
    snap = SlurmSnapshot(tuple(SlurmNode(n, ("debug",), g, "mixed", (), "") for n, g in sorted(sizes.items())),
                         tuple(SlurmJob(jid, "het-exp", "u", "RUNNING", "debug", {n: tuple(range(g)) for n, g in nodes.items()},
                                        {}, batch, "30", off) for jid, off, batch, nodes in records), ())
    slots = [(n, g) for n in ("n1", "n3", "n4") for g in range(sizes[n])]
    entries = tuple(RankEntry(r, n, g, 0, r, 0, comp[n]) for r, (n, g) in enumerate(slots))
    job = ElasticJob(1, "het-exp", "30", "pp1tp1dp8", 4, "n3", 1, entries, ("n1", "n3", "n4"), sizes, comp)
    spec = {"model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256},
            "layouts": {"4": "pp1tp1dp4", "6": "pp1tp1dp6", "8": "pp1tp1dp8"}}
    view = build_from_slurm(snap, [job])
    (p,) = preview(view, [job], {1: spec}, ["n4"], lambda job, leaving: None).jobs
    assert (p.to_layout, p.nodes_released, p.stays) == ("pp1tp1dp6", (), ("n4",))
    assert p.notes == ("component 0 (Slurm job 30): Slurm cannot resize a heterogeneous job's leader component; "
                       "n4 stays allocated, idle",)
    (p,) = preview(view, [job], {1: spec}, ["n1"], lambda job, leaving: None).jobs
    assert (p.to_layout, p.nodes_released, p.stays, p.notes) == (
        "pp1tp1dp4", ("n1",), (), ("component 1 (Slurm job 31) cancelled: n1 released",))


def _het_view(records, ranks: dict[str, int], pinned: str, min_nodes: int):
    """/cluster's view of one elastic job whose Slurm records are `records` ((job id, offset, batch host,
    {node: GPUs})), with ranks[node] ranks on each node's first GPUs."""
    from dashboard.slurm_reader import SlurmJob

    sizes = {n: g for _, _, _, nodes in records for n, g in nodes.items()}
    comp = {n: off for _, off, _, nodes in records for n in nodes}
    snap = SlurmSnapshot(tuple(SlurmNode(n, ("debug",), g, "mixed", (), "") for n, g in sorted(sizes.items())),
                         tuple(SlurmJob(jid, "het-exp", "u", "RUNNING", "debug", {n: tuple(range(g)) for n, g in nodes.items()},
                                        {}, batch, records[0][0], off) for jid, off, batch, nodes in records), ())
    slots = [(n, g) for n in sorted(ranks) for g in range(ranks[n])]
    entries = tuple(RankEntry(r, n, g, 0, r, 0, comp[n]) for r, (n, g) in enumerate(slots))
    job = ElasticJob(1, "het-exp", records[0][0], f"pp1tp1dp{len(slots)}", 4, pinned, min_nodes, entries,
                     tuple(sorted(sizes)), sizes, comp)
    (gain,) = build_from_slurm(snap, [job]).shrink
    return gain


def test_shrink_to_min_shows_only_what_slurm_releases_from_a_heterogeneous_job() -> None:
    """The "shrink to MIN" panel against Slurm 22.05's rules as measured on the testbed (docs/reference/slurm.md,
    "Heterogeneous jobs"): the leader component cannot be resized at all, a non-leader component goes
    whole (scancel) or shrinks (scontrol update) but never loses its batch host. Expected values are
    worked out by hand from those rules."""
    # the guide's script: leader n3, n4 (2 GPUs each, batch host n3), component 1 on n1 (4 GPUs); MIN 1
    gain = _het_view([("30", 0, "n3", {"n3": 2, "n4": 2}), ("31", 1, "n1", {"n1": 4})],
                     {"n1": 4, "n3": 2, "n4": 2}, "n3", 1)
    assert (gain.released, gain.gpus_freed, gain.whole_nodes, gain.stays) == (("n1",), 4, ("n1",), ("n4",))
    assert any("leader component" in note and "n4" in note for note in gain.notes), gain.notes
    # leader n1; component 1 on n3 (its batch host, 1 rank) and n4 (2 ranks); MIN 2: n3 is kept, n4 released
    gain = _het_view([("19", 0, "n1", {"n1": 4}), ("20", 1, "n3", {"n3": 2, "n4": 2})],
                     {"n1": 4, "n3": 1, "n4": 2}, "n1", 2)
    assert (gain.released, gain.gpus_freed, gain.stays) == (("n4",), 2, ())


def test_shrink_to_min_on_the_local_view_keeps_the_leader_component(admin, store) -> None:
    """Without Slurm (the database's components alone): the seeded job's leader component a1, a2 and
    component 1 b1, b2, MIN 1: a2 stays allocated (the leader cannot be resized), b1 and b2 go."""
    job = seed_hetjob(store)
    html = admin.get("/cluster").text
    row = html.split(f'<tr data-elastic-job="{job}">', 1)[1].split("</tr>", 1)[0]
    cells = dict(re.findall(r'<td class="(released|gpus-freed|stays)">([^<]*)', row))
    assert cells == {"released": "b1, b2", "gpus-freed": "4", "stays": "a2"}, row
