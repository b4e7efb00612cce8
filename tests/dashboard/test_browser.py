"""Real-browser checks (Debian's Chromium driven by Playwright): live polling and an admin action.

Run with `pytest -m browser tests/dashboard`. The fixture installs what it needs through
scripts/install-browser.sh and fails loudly when that is impossible. Set
ELASTIC_SCREENSHOT_DIR to keep screenshots of the pages it visits.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from dashboard import create_app
from db import Store
from tests.dashboard.conftest import PASSWORDS, SECRET
from tests.db.seed import HET_NODES, layout_entries, seed_hetjob, spread_llama

pytestmark = pytest.mark.browser
from tests.paths import ROOT
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "install-browser.sh")], capture_output=True, text=True,
                          env={**os.environ, "ELASTIC_VENV_PYTHON": sys.executable}, timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"scripts/install-browser.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def server(db_url: str) -> Iterator[str]:
    """The app on 127.0.0.1, a free port, in a thread; yields its base URL."""
    from werkzeug.serving import make_server

    app = create_app({"DB_URL": db_url, "SECRET_KEY": SECRET})
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    thread.join(5)
    app.extensions["elastic_store"].close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    p = context.new_page()
    p.set_default_timeout(10_000)
    yield p
    context.close()


def _login(page: Any, base: str, role: str) -> None:
    page.goto(f"{base}/jobs/1")
    assert "/login" in page.url  # anonymous -> login form
    page.fill("input[name=username]", role)
    page.fill("input[name=password]", PASSWORDS[role])
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/jobs/1")


def _shot(page: Any, name: str, tmp_path: Path) -> None:
    """Keep a screenshot only where ELASTIC_SCREENSHOT_DIR asks for it: a full-page screenshot checks
    nothing and, on a loaded machine, can take longer than Playwright's 10 s (it failed a CI run so)."""
    if not os.environ.get("ELASTIC_SCREENSHOT_DIR"):
        return
    target = Path(os.environ["ELASTIC_SCREENSHOT_DIR"])
    target.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target / name), full_page=True)


def test_placement_grid_follows_new_rank_map_without_reload(page: Any, server: str, db_url: str,
                                                            tmp_path: Path) -> None:
    _login(page, server, "viewer")
    cell = page.locator('#placement tr[data-node="n1"] td[data-gpu="3"]')
    assert "pp1 tp1 dp0" in cell.inner_text()
    assert page.locator("#panels").get_attribute("data-epoch") == "1"
    _shot(page, "placement-before.png", tmp_path)
    page.evaluate("window.__sameDocument = true")

    store = Store(db_url)  # a second writer, as the launcher would be
    frag = store.fragmentation(1)
    mid = store.start_migration(1, "pp2tp2dp1", "pp4tp1dp1", "demo", {"pairs": 2}, frag)
    store.record_rank_map(1, 2, "pp4tp1dp1", layout_entries(4, 1, 1, ["n1"], 4))
    store.finish_migration(mid, "succeeded", 10, 100, True, {"execute": 0.1}, fragmentation_after=store.fragmentation(1))
    store.close()

    page.wait_for_selector('#panels[data-epoch="2"]')
    assert page.evaluate("window.__sameDocument") is True  # updated by htmx polling, not a reload
    assert "pp3 tp0 dp0" in cell.inner_text()
    assert "pp4tp1dp1" in page.locator("#placement h3").inner_text()
    _shot(page, "placement-after.png", tmp_path)


def test_admin_preempt_queues_request_and_audit(page: Any, server: str, db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    spread_llama(store)  # a preempt may not take a job's last node (issue 12 item 8)
    store.close()
    _login(page, server, "admin")
    page.fill("form[action$='/preempt'] input[name=count]", "1")
    page.click("button[name=preempt]")
    page.wait_for_selector("#action-result [data-request-id]")
    rid = int(page.locator("#action-result [data-request-id]").get_attribute("data-request-id"))

    store = Store(db_url)
    (req,) = store.pending_requests(1)
    assert (req.id, req.action, req.params, req.requested_by) == (rid, "preempt", {"count": 1}, "admin")
    audit = store.audit_log(target="job:1")[0]
    assert audit.who == "admin" and audit.action == "preempt" and f"request {rid}" in audit.result
    store.close()

    # HX-Trigger refreshed the panels: the request row shows without a reload.
    page.wait_for_selector(f'#requests tr[data-request-id="{rid}"]')
    assert "pending" in page.locator(f'#requests tr[data-request-id="{rid}"]').inner_text()
    _shot(page, "after-preempt.png", tmp_path)


def test_login_with_an_offsite_next_stays_on_the_site_under_the_csp(page: Any, server: str) -> None:
    """Issue 12 item 1: Chromium followed `next=/<TAB>/evil.example` off-site; the CSP must not
    break the pages either (no violation reported while logging in and polling)."""
    violations: list[str] = []
    page.on("console", lambda msg: violations.append(msg.text) if "Content Security Policy" in msg.text else None)
    page.goto(f"{server}/login")
    page.evaluate("document.querySelector('input[name=next]').value = '/\\t/evil.example/phish'")
    page.fill("input[name=username]", "viewer")
    page.fill("input[name=password]", PASSWORDS["viewer"])
    page.click("button[type=submit]")
    page.wait_for_url(f"{server}/")
    page.wait_for_timeout(2500)  # one poll of the jobs table
    assert page.url == f"{server}/" and violations == []


_GEOMETRY = """() => Array.from(document.querySelectorAll('tr[data-node]')).map(tr => {
  const cells = Array.from(tr.querySelectorAll('td.cell')).map(td => td.getBoundingClientRect());
  const node = getComputedStyle(tr.querySelector('td.node'));
  return {node: tr.dataset.node, widths: cells.map(r => r.width),
          extent: cells.length ? cells[cells.length - 1].right - cells[0].left : 0,
          bar: [node.borderLeftStyle, node.borderLeftWidth, node.borderLeftColor],
          badges: Array.from(tr.querySelectorAll('.comp-badge')).filter(b => b.offsetWidth > 0).map(b => b.innerText)};
})"""


def _drawn(page: Any) -> dict[str, dict[str, Any]]:
    return {r["node"]: r for r in page.evaluate(_GEOMETRY)}


def test_uneven_nodes_drawn_to_their_width_with_component_marks(page: Any, server: str, db_url: str,
                                                                tmp_path: Path) -> None:
    """Issue 13 item 5, in Chromium: a heterogeneous job on 4,4,2,2 GPU nodes (components 0 and 1),
    recorded through the Store. On the job page and on /cluster every node is drawn one cell per GPU it
    has (a 4-GPU node twice as wide as a 2-GPU one) with a visible component badge and a coloured bar
    that differs between components; the strict CSP reports nothing."""
    violations: list[str] = []
    page.on("console", lambda msg: violations.append(msg.text) if "Content Security Policy" in msg.text else None)
    store = Store(db_url)
    job = seed_hetjob(store)
    store.close()
    sizes = {name: gpus for name, gpus, _ in HET_NODES}
    comps = {name: comp for name, _, comp in HET_NODES}
    _login(page, server, "admin")
    for url in (f"{server}/jobs/{job}", f"{server}/cluster"):
        page.goto(url)
        page.wait_for_selector('tr[data-node="b2"] .comp-badge')
        page.wait_for_timeout(300)  # let layout settle
        drawn = _drawn(page)
        cell = drawn["a1"]["widths"][0]
        assert cell > 20
        for name, gpus in sizes.items():
            row = drawn[name]
            assert len(row["widths"]) == gpus, (url, name, row)
            assert all(abs(w - cell) <= 1 for w in row["widths"]), (url, name, row)  # cells alike
            assert abs(row["extent"] - gpus * cell) <= gpus + 1, (url, name, row)  # as wide as its GPUs
            assert row["bar"][0] == "solid" and row["bar"][1] == "6px", (url, name, row)
            assert [b.endswith(f"component {comps[name]}") for b in row["badges"]] == [True], (url, name, row)
        assert abs(drawn["a1"]["extent"] / drawn["b1"]["extent"] - 2) < 0.05, url
        assert drawn["a1"]["bar"][2] == drawn["a2"]["bar"][2] != drawn["b1"]["bar"][2] == drawn["b2"]["bar"][2]
        _shot(page, "hetjob-" + url.rsplit("/", 1)[-1] + ".png", tmp_path)
    # /cluster's "shrink to MIN" (MIN 1): Slurm cannot resize the leader component (a1, a2), so a2 stays
    # allocated, idle, and only component 1's b1, b2 and their 2 + 2 GPUs are offered as freed
    row = page.locator(f'#shrink-gains tr[data-elastic-job="{job}"]')
    assert [row.locator(f"td.{c}").inner_text() for c in ("released", "gpus-freed")] == ["b1, b2", "4"]
    assert row.locator("td.stays").inner_text().startswith("a2")
    assert violations == []


def test_cluster_preempt_dry_run_says_a_leader_component_node_stays(page: Any, server: str, db_url: str,
                                                                    tmp_path: Path) -> None:
    """In Chromium: /cluster's preempt dry run of a2, a node of the heterogeneous job's leader component
    (which Slurm 22.05 cannot resize, docs/reference/slurm.md), says the ranks leave it but it stays allocated, idle, and
    releases nothing; b2 (component 1, which shrinks) is released."""
    from tests.dashboard.test_hetjob_grid import HET_SPEC

    store = Store(db_url)
    job = seed_hetjob(store)
    store.set_launch_spec(job, HET_SPEC)
    store.close()
    _login(page, server, "admin")
    page.goto(f"{server}/cluster")
    for picked, released, stays in (("a2", None, "a2"), ("b2", "b2", None)):
        for box in page.locator("#preempt-pick input[name=node]").all():
            box.set_checked(box.get_attribute("value") == picked)
        page.click("#preempt-pick button[name=preview]")
        plan = page.locator(f'#preempt-plan[data-nodes="{picked}"] .preview-job[data-elastic-job="{job}"]')
        plan.wait_for()
        text = plan.inner_text()
        assert plan.get_attribute("data-refused") == "no" and "pp2tp2dp3 →" in text, text
        assert [x.inner_text() for x in plan.locator(".released").all()] == ([released] if released else []), text
        assert [x.inner_text() for x in plan.locator(".stays").all()] == ([stays] if stays else []), text
        if stays:
            assert f"{stays} stays allocated, idle" in text and "releases" not in text, text
            assert "cannot resize a heterogeneous job's leader component" in plan.locator(".release-notes").inner_text()
        _shot(page, f"preempt-dry-run-{picked}.png", tmp_path)


def test_a_migrations_notes_on_its_page_and_in_the_history_table(page: Any, server: str, db_url: str) -> None:
    """In Chromium: the launcher's notes of a restart (workers SIGKILLed after --term-timeout, a component
    giving a node back) are listed on its migration page and in /history's notes column."""
    notes = ["workers on n2 did not exit within --term-timeout 5 s of SIGTERM; killed",
             "component 1 (Slurm job 20): n4 released (scontrol update)"]
    store = Store(db_url)
    mid = store.start_migration(1, "pp2tp2dp1", "pp2tp2dp2", "resize", {"restart": 1}, {}, kind="restart")
    store.add_migration_notes(mid, notes)
    store.finish_migration(mid, "succeeded", None, None, None, {"stop": 5.2})
    store.close()
    _login(page, server, "viewer")
    page.goto(f"{server}/migrations/{mid}")
    assert page.locator("#notes li").all_inner_texts() == notes
    assert "restart" in page.locator("#kind").inner_text()
    page.goto(f"{server}/history")
    row = page.locator("#history-table tbody tr", has=page.locator(f'a[href="/migrations/{mid}"]'))
    assert row.locator("td.notes li").all_inner_texts() == notes


def test_an_admin_switches_a_jobs_policy_on_the_cluster_page(page: Any, server: str, db_url: str) -> None:
    """In Chromium: /cluster's policy panel shows llama on opportunistic with the pending job its launcher
    watches; the admin switches it to manual, the panel refreshes (HX-Trigger) to manual with nothing held
    above MIN, and the switch is in the audit log."""
    store = Store(db_url)
    store.set_policy(1, "opportunistic")
    store.record_policy_watch(1, {"held": 3, "idle": [], "peers": [], "decision": None,
                                  "pending": [{"job_id": 77, "name": "plain", "nodes": 4, "reason": "Resources"}]})
    store.close()
    _login(page, server, "admin")
    page.goto(f"{server}/cluster")
    row = page.locator('#policies tr[data-elastic-job="1"]')
    assert row.get_attribute("data-policy") == "opportunistic"
    assert "#77 plain: 4 node(s) (Resources)" in row.locator("td.watching").inner_text()
    row.locator("button[name=policy]").click()
    page.locator("#policy-result", has_text="Policy of llama: opportunistic → manual").wait_for()
    page.wait_for_selector('#policies tr[data-elastic-job="1"][data-policy="manual"]')
    assert page.locator('#policies tr[data-elastic-job="1"] td.above-min').inner_text() == "–"
    store = Store(db_url)
    try:
        assert store.get_job(1).policy == "manual"
        assert store.audit_log(target="job:1")[0].result == "switched: opportunistic -> manual"
    finally:
        store.close()


def test_the_job_page_leads_with_state_step_loss_and_pauses_and_a_finished_job_offers_no_actions(
        page: Any, server: str, db_url: str) -> None:
    """In Chromium: the summary (state, step, loss by step, last pauses) sits above the placement grid; when the
    job finishes the polled summary says so, and a reload shows no action buttons."""
    store = Store(db_url)
    for i in range(1, 31):
        store.record_step(1, i, 4.0 - 0.05 * i, "pp2tp2dp1")
    store.update_job(1, last_step=30)
    store.close()
    _login(page, server, "admin")
    summary, placement = page.locator("#summary"), page.locator("#placement")
    assert summary.bounding_box()["y"] < placement.bounding_box()["y"]
    assert page.locator("#job-step").inner_text() == "30" and page.locator("#job-state").inner_text() == "running"
    assert page.locator("#summary-loss-chart path.line").get_attribute("data-points") == "30"
    assert "10.250 s" in page.locator('#pauses tr[data-migration="1"] td.pause').inner_text()
    assert page.locator("button[name=shrink]").is_visible()
    store = Store(db_url)
    store.set_job_state(1, "finished")
    store.close()
    page.wait_for_selector('#job-state:text("finished")')  # the panels' polling, no reload
    page.reload()
    assert page.locator("#no-actions").is_visible() and page.locator("button[name=shrink]").count() == 0
