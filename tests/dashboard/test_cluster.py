"""The cluster view without a browser: the Slurm reader against recorded Slurm 22.05 output (from the
testbed: tests/dashboard/data), the view built from it, fragmentation figures checked against a
brute-force count, and /cluster on the local backend's nodes from the seeded database."""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from dashboard.cluster import ElasticJob, GpuCell, NodeView, build_from_slurm, build_local, fragmentation
from dashboard.slurm_reader import (
    SlurmReadError,
    SlurmSnapshot,
    expand_hostlist,
    parse_reservations,
    parse_sinfo,
    parse_squeue,
)
from db.records import RankEntry
from launcher.backends.slurm.gres import gres_count, gres_indices
from tests.db.seed import layout_entries

DATA = Path(__file__).resolve().parent / "data"


def _snapshot(name: str) -> SlurmSnapshot:
    res = (DATA / f"reservations-{name}.txt")
    return SlurmSnapshot(tuple(parse_sinfo((DATA / f"sinfo-{name}.json").read_text())),
                         tuple(parse_squeue((DATA / f"squeue-{name}.json").read_text())),
                         tuple(parse_reservations(res.read_text())) if res.exists() else ())


@pytest.mark.parametrize("text, names", [
    ("n1", ["n1"]), ("n[1-3,7]", ["n1", "n2", "n3", "n7"]), ("g[08-10],x1", ["g08", "g09", "g10", "x1"]),
    ("a[1-2]b", ["a1b", "a2b"]),
])
def test_hostlists_expand(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


def test_bad_hostlist_is_a_clear_error() -> None:
    with pytest.raises(SlurmReadError, match="bad range"):
        expand_hostlist("n[1-x]")


@pytest.mark.parametrize("gres, count, idx", [
    ("gpu:4", 4, None), ("gpu:2(IDX:0-1)", 2, (0, 1)), ("gpu:a100:3(IDX:0,2-3)", 3, (0, 2, 3)),
    ("gpu:2,shard:8", 2, None), ("", 0, ()), ("gpu:0", 0, ()), ("shard:2(IDX:0)", 0, ()),
])
def test_gres_strings(gres: str, count: int, idx: tuple[int, ...] | None) -> None:
    assert gres_count(gres) == count
    assert gres_indices(gres) == idx


def test_slurm_errors_and_garbage_are_one_line_errors() -> None:
    with pytest.raises(SlurmReadError, match="sinfo --json. did not print JSON"):
        parse_sinfo("sinfo: error: ...")
    with pytest.raises(SlurmReadError, match="reported: Unable to contact"):
        parse_squeue('{"errors": ["Unable to contact slurm controller"], "jobs": []}')


def test_recorded_elastic_job_with_a_companion() -> None:
    """Recorded while a 2-node elastic job (2 GPUs per node) grew through a companion job."""
    snap = _snapshot("companion")
    assert [n.name for n in snap.nodes] == ["n1", "n2", "n3", "n4"]
    assert all(n.gpus == 4 and n.partitions == ("debug",) for n in snap.nodes)
    jobs = {j.job_id: j for j in snap.jobs}
    assert set(jobs) == {"2", "3"}  # the completed job 1 holds nothing
    assert dict(jobs["2"].gpus) == {"n1": (0, 1), "n2": (0, 1)} and jobs["2"].batch_host == "n1"
    assert jobs["3"].name == "elastic-co-companion-1" and dict(jobs["3"].gpus) == {"n3": (0, 1), "n4": (0, 1)}

    entries = tuple(RankEntry(r, n, g, r // 2, 0, g) for r, (n, g) in
                    enumerate(itertools.product(["n1", "n2", "n3", "n4"], [0, 1])))
    job = ElasticJob(7, "elastic-co", "2", "pp4tp2dp1", 2, "n1", 2, entries)
    view = build_from_slurm(snap, [job])
    kinds = {(n.name, g.index): (g.kind, g.rank) for n in view.nodes for g in n.gpus}
    assert kinds[("n3", 1)] == ("elastic", 5) and kinds[("n4", 2)] == ("idle", None)
    f = view.fragmentation
    assert (f.gpus_total, f.gpus_free, f.stranded, f.free_nodes, f.largest_free_block, f.index) == (16, 8, 8, 0, 0, 1.0)
    (gain,) = view.shrink
    # MIN 2: keep the pinned batch node and the job's own n2 before the companion's nodes
    assert gain.released == ("n3", "n4") and gain.gpus_freed == 4 and gain.whole_nodes == ("n3", "n4")


def _oracle(grid: dict[str, list[str]], unusable: set[str]) -> tuple[int, int, int, int]:
    """Brute force: (free, stranded, whole free nodes, longest run of whole free nodes)."""
    free = stranded = whole = best = run = 0
    for name, cells in grid.items():
        ok = name not in unusable
        idle = cells.count("idle")
        if ok:
            free += idle
            stranded += idle if idle < len(cells) else 0
            whole += idle == len(cells)
        run = run + 1 if ok and idle == len(cells) else 0
        best = max(best, run)
    return free, stranded, whole, best


def test_fragmentation_matches_a_brute_force_count() -> None:
    rng = random.Random(16)
    for _ in range(300):
        grid = {f"n{i}": [rng.choice(["idle", "idle", "job", "elastic"]) for _ in range(rng.randint(1, 4))]
                for i in range(rng.randint(1, 7))}
        unusable = {n for n in grid if rng.random() < 0.2}
        nodes = [NodeView(n, "idle", ("drained",) if n in unusable else (),
                          tuple(GpuCell(i, k) for i, k in enumerate(cells))) for n, cells in grid.items()]
        f = fragmentation(nodes)
        free, stranded, whole, best = _oracle(grid, unusable)
        assert (f.gpus_free, f.stranded, f.free_nodes, f.largest_free_block) == (free, stranded, whole, best)
        assert f.index == (round(stranded / free, 4) if free else 0.0)


def test_local_view_from_the_database_alone() -> None:
    llama = ElasticJob(1, "llama", None, "pp2tp2dp1", 4, "n0", 1, tuple(layout_entries(2, 2, 1, ["n1"], 4)),
                       ("n0", "n1"))
    bert = ElasticJob(2, "bert", None, "pp1tp2dp1", 4, None, 1,
                      tuple(layout_entries(1, 2, 1, ["n2"], 4, first_gpu=2)), ("n2",))
    view = build_local([llama, bert], failed_nodes=["n3"])
    assert view.source == "local" and [n.name for n in view.nodes] == ["n0", "n1", "n2"]
    n2 = view.nodes[2]
    assert [g.kind for g in n2.gpus] == ["idle", "idle", "elastic", "elastic"] and n2.stranded == 2
    assert view.nodes[0].gpus[0].kind == "held"  # the pinned batch node: held, no rank
    gains = {g.name: g for g in view.shrink}
    assert gains["llama"].released == ("n1",) and gains["llama"].whole_nodes == ("n1",)
    assert gains["bert"].released == ()


def test_cluster_page_on_the_local_backend(admin, store) -> None:
    page = admin.get("/cluster")
    assert page.status_code == 200
    html = page.text
    assert 'data-source="local"' in html
    assert html.count('data-kind="elastic"') == 6  # llama's 4 ranks on n1, bert's 2 on n2
    assert 'data-node="n2"' in html and "llama r0" in html and "bert r1" in html
    assert 'id="history-chart"' in html
    assert store.cluster_samples()[-1].figures.gpus_total == 12  # n0, n1, n2 x 4 GPUs; the visit left a sample
    partial = admin.get("/cluster", headers={"HX-Request": "true"})
    assert 'id="cluster-panels"' in partial.text
    assert "<html" not in partial.text


def test_unreachable_slurm_is_a_503_or_a_fallback(db_url: str, tmp_path: Path) -> None:
    from dashboard import create_app
    from tests.dashboard.conftest import SECRET, login

    bad = {"PATH": str(tmp_path)}  # no Slurm client there (a missing slurm.conf makes sinfo retry for 60 s)
    strict = create_app({"DB_URL": db_url, "SECRET_KEY": SECRET, "CLUSTER_SOURCE": "slurm", "SLURM_ENV": bad})
    client = strict.test_client()
    login(client, "viewer")
    resp = client.get("/cluster")
    assert resp.status_code == 503 and "scontrol is not installed" in resp.text
    auto = create_app({"DB_URL": db_url, "SECRET_KEY": SECRET, "CLUSTER_SOURCE": "auto", "SLURM_ENV": bad})
    client = auto.test_client()
    login(client, "viewer")
    resp = client.get("/cluster")
    assert resp.status_code == 200 and 'id="cluster-warning"' in resp.text and 'data-source="local"' in resp.text


def test_recorded_plain_jobs_a_drained_and_a_reserved_node() -> None:
    """Recorded with two plain sbatch jobs on n1 (gpu:1, gpu:2), n4 drained, a reservation on n3,
    and a job pending behind it."""
    snap = _snapshot("plain")
    assert snap.reserved_nodes == {"n3"}
    assert {j.job_id: dict(j.gpus) for j in snap.jobs} == {"23": {"n1": (0,)}, "24": {"n1": (1, 2)}}
    view = build_from_slurm(snap, [])
    nodes = {n.name: n for n in view.nodes}
    assert [(g.kind, g.job) for g in nodes["n1"].gpus] == [("job", "23"), ("job", "24"), ("job", "24"), ("idle", "")]
    assert nodes["n4"].marks == ("drained",) and nodes["n4"].reason == "disk-check"
    assert nodes["n3"].marks == ("reserved",) and nodes["n2"].marks == ()
    f = view.fragmentation
    assert (f.gpus_total, f.gpus_free, f.stranded, f.free_nodes, f.largest_free_block, f.index) == (16, 5, 1, 1, 1, 0.2)
    assert view.shrink == ()
    assert build_from_slurm(snap, [], partitions=["other"]).nodes == ()


def test_the_policy_panels_show_what_each_job_holds_above_min_watches_and_decided(admin, store) -> None:
    """llama on the opportunistic policy, its launcher's last look recorded (db.store_policy), one resize the
    policy caused: /cluster names the nodes it would yield first (n1, n2: what a shrink to MIN releases, n0
    being its batch node; also badged on the grid), the pending job it watches, its decision, and the decision in the timeline."""
    store.set_policy(1, "opportunistic")
    store.record_policy_watch(1, {"held": 2, "idle": [], "peers": [],
                                  "pending": [{"job_id": 77, "name": "plain", "nodes": 2, "reason": "Resources"}],
                                  "decision": {"nodes": 1, "reason": "job 77 (plain) pending for 2 node(s)"}})
    mid = store.start_migration(1, "pp2tp2dp1", "pp1tp2dp1", "policy", {}, {})
    store.add_migration_notes(mid, ["policy: job 77 (plain) pending for 2 node(s) (Resources), 0 idle: giving 1 back"])
    store.finish_migration(mid, "succeeded", 10, 100, True, {"plan": 0.1})
    html = admin.get("/cluster", headers={"HX-Request": "true"}).text
    panel = html.split('id="policies"', 1)[1].split("</section>", 1)[0]
    llama = panel.split('data-elastic-job="1"', 1)[1].split("</tr>", 1)[0]
    assert 'data-policy="opportunistic"' in html and "switch to manual" in llama
    assert '<td class="above-min">n1, n2</td>' in llama and "<td>3 (1)</td>" in llama
    assert "#77 plain: 2 node(s) (Resources)" in llama and "to 1 node(s): job 77 (plain)" in llama
    bert = panel.split('data-elastic-job="2"', 1)[1].split("</tr>", 1)[0]
    assert '<td class="above-min">–</td>' in bert and "switch to opportunistic" in bert  # manual: holds nothing "above"
    grid = html.split('id="cluster-nodes"', 1)[1].split("</section>", 1)[0]
    badged = [row.split('"', 1)[0] for row in grid.split('<tr data-node="')[1:] if "above MIN · llama" in row]
    assert badged == ["n1", "n2"]
    decisions = html.split('id="policy-decisions"', 1)[1].split("</section>", 1)[0]
    assert f'data-migration="{mid}"' in decisions and "giving 1 back" in decisions and "pp2tp2dp1 → pp1tp2dp1" in decisions


def test_viewers_see_the_policies_but_no_switch(viewer) -> None:
    html = viewer.get("/cluster").text
    assert 'id="policies"' in html and "switch to" not in html
