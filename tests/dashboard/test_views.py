"""Every read-only route, full pages and htmx partials, and the history filters."""
from __future__ import annotations

import csv
import io
import re
from typing import Any

import pytest

from db import Store
from tests.db.backends import both_backends

pytestmark = both_backends  # every test here runs on SQLite and on a real PostgreSQL server


@pytest.mark.parametrize("url", ["/", "/jobs/1", "/migrations/1", "/history", "/history?format=csv"])
def test_anonymous_is_redirected_to_login(anon: Any, url: str) -> None:
    resp = anon.get(url)
    assert resp.status_code == 302 and resp.headers["Location"].startswith("/login")


def test_anonymous_htmx_poll_gets_hx_redirect(anon: Any) -> None:
    resp = anon.get("/jobs/1", headers={"HX-Request": "true"})
    assert resp.status_code == 401 and resp.headers["HX-Redirect"] == "/login"


def test_login_rejects_bad_password_and_redirects_only_locally(anon: Any) -> None:
    from tests.dashboard.conftest import csrf_of

    token = csrf_of(anon.get("/login").text)
    assert anon.post("/login", data={"username": "admin", "password": "nope", "csrf_token": token}).status_code == 401
    resp = anon.post("/login", data={"username": "admin", "password": "admin-password", "csrf_token": token,
                                     "next": "//evil.example/"})
    assert resp.headers["Location"] == "/"


def test_jobs_overview(viewer: Any) -> None:
    page = viewer.get("/")
    assert page.status_code == 200 and "htmx.min.js" in page.text
    assert "llama" in page.text and "bert" in page.text and "pp2tp2dp1" in page.text
    assert 'class="sla-bad"' in page.text and 'class="sla-ok"' in page.text  # llama misses premium, bert meets standard
    part = viewer.get("/", headers={"HX-Request": "true"})
    assert part.text.lstrip().startswith("{#") is False and "<html" not in part.text and 'id="jobs-table"' in part.text
    assert 'data-poll hx-trigger="every 2s"' in part.text


def test_job_placement_page_and_partial(viewer: Any) -> None:
    page = viewer.get("/jobs/1")
    assert page.status_code == 200 and "<html" in page.text
    text = page.text
    assert 'data-epoch="1"' in text and 'data-rank="3"' in text and "pp1 tp1 dp0" in text
    assert "pinned" in text and "cell other" in text and "cell idle" in text
    assert 'data-poll hx-trigger="every 2s,' in text and "elastic-refresh from:body" in text
    assert "Fragmentation" in text and "#1</a> resize" in text
    assert "Preempt</button>" not in text  # viewers get no action forms
    part = viewer.get("/jobs/1", headers={"HX-Request": "true"})
    assert "<html" not in part.text and part.text.lstrip().startswith('<div id="panels"')
    assert viewer.get("/jobs/999").status_code == 404


def test_admin_sees_action_forms_with_csrf(admin: Any) -> None:
    text = admin.get("/jobs/1").text
    for action in ("preempt", "shrink", "grow", "suspend", "resume"):
        assert f'/jobs/1/{action}"' in text
    assert text.count('name="csrf_token"') >= 6


def test_migration_page(viewer: Any) -> None:
    text = viewer.get("/migrations/1").text
    assert "<svg" in text and 'data-label="execute" data-value="6.0"' in text
    assert 'data-label="moved"' in text and 'data-label="checkpoint"' in text and "12.5%" in text
    assert "bit-exact" in text and "instructions" in text and "pp2tp2dp2 → pp2tp2dp1" in text
    assert "Training paused:" in text and "10.250 s" in text
    assert viewer.get("/migrations/42").status_code == 404


def test_a_migration_that_moved_nothing_claims_no_comparison(viewer: Any, store: Store) -> None:
    """A recovery where the survivors already held their state moves no byte: the page says nothing was
    compared instead of 'bit-exact' or 'not verified' (the record's bit_exact is null)."""
    mid = store.start_migration(1, "pp2tp1dp2", "pp2tp1dp1", "failure", {}, {})
    store.finish_migration(mid, "succeeded", 0, 1000, None, {"plan": 0.01})
    verification = viewer.get(f"/migrations/{mid}").text.split('id="verification"', 1)[1].split("</p>", 1)[0]
    assert "nothing to compare" in verification and "bit-exact" not in verification


def test_migration_page_and_history_show_notes_and_why_declined(viewer: Any, store: Store) -> None:
    """The launcher's notes (workers SIGKILLed after --term-timeout, a component giving nodes back) and a
    decline's reason are on the migration page and in the history table, each note as its own item."""
    killed = "workers on n2 did not exit within --term-timeout 5 s of SIGTERM; killed"
    released = "component 1 (Slurm job 20): n4 released (scontrol update)"
    mid = store.start_migration(1, "pp2tp2dp1", "pp2tp2dp2", "resize", {"restart": 1}, {}, kind="restart")
    store.add_migration_notes(mid, [killed, released])
    store.finish_migration(mid, "succeeded", None, None, None, {"stop": 5.2})
    grow = store.start_migration(1, "pp2tp2dp1", "pp2tp2dp2", "resize", {}, {})
    store.finish_migration(grow, "declined", None, None, None, {}, error="training ended first")
    page = viewer.get(f"/migrations/{mid}").text
    notes = page.split('id="notes"', 1)[1].split("</div>", 1)[0]
    assert re.findall(r"<li>([^<]*)</li>", notes) == [killed, released]
    assert "[&#39;" not in page and "restart" in page.split('id="plan"', 1)[1]  # not as a Python list
    assert "Declined: training ended first" in viewer.get(f"/migrations/{grow}").text
    assert "nothing happened besides the plan" in viewer.get("/migrations/1").text
    assert 'id="kind"' in page and 'id="kind"' not in viewer.get("/migrations/1").text  # a restart says so
    table = viewer.get("/history?job=llama").text
    cells = re.findall(r'<td class="notes">(.*?)</td>', table, re.S)
    assert len(cells) == 3 and "training ended first" in cells[0] and cells[2] == "–"
    assert re.findall(r"<li>([^<]*)</li>", cells[1]) == [killed, released]
    assert re.findall(r"<td>resize( \(restart\))?</td>", table) == ["", " (restart)", ""]


def test_history_page_partial_and_exports(viewer: Any, store: Store) -> None:
    page = viewer.get("/history?trigger=resize")
    assert page.status_code == 200 and "1 migration " in page.text
    part = viewer.get("/history?status=failed", headers={"HX-Request": "true"})
    assert part.text.startswith('<div id="history-table"') and "No migrations match" in part.text
    rows = list(csv.DictReader(io.StringIO(viewer.get("/history?format=csv&job=llama").text)))
    assert rows == [{k: "" if v is None else "; ".join(v) if isinstance(v, list) else str(v) for k, v in r.items()}
                    for r in store.history(job="llama")]
    assert viewer.get("/history?format=json&since=2024-05-01").get_json() == store.history(since=None)


def test_a_failed_jobs_page_says_why(viewer: Any, store: Store) -> None:
    assert 'id="why-failed"' not in viewer.get("/jobs/1").text  # running
    store.set_job_state(1, "failed", why="workers [3] kept failing: --max-restarts 1 is used up")
    part = viewer.get("/jobs/1", headers={"HX-Request": "true"}).text  # the panels the page polls
    assert '<p class="err" id="why-failed">Failed: workers [3] kept failing: --max-restarts 1 is used up</p>' in part


def test_history_filter_of_an_unknown_job_says_so(viewer: Any) -> None:
    assert "No job lama in the database" in viewer.get("/history?job=lama").text
    page = viewer.get("/history?job=bert").text  # a job without migrations
    assert "No migrations match" in page and "No job" not in page
    assert viewer.get("/history?job=lama&format=json").get_json() == []


def test_history_paging(viewer: Any, store: Store) -> None:
    for _ in range(30):
        store.start_migration(1, "a", "b", "demo", {}, {})
    first = viewer.get("/history").text
    assert "Page 1 of 2" in first and "page=2" in first
    assert "Page 2 of 2" in viewer.get("/history?page=2").text


@pytest.mark.parametrize("query", [
    "since=notadate", "until=2024-99-99", "trigger=x%27%3B+DROP+TABLE+migrations", "status=bogus",
    "page=0", "page=abc", "format=xml", "limit=0", "since=2024-06-01&until=2024-05-01",
])
def test_malformed_history_filters_are_400(viewer: Any, store: Store, query: str) -> None:
    resp = viewer.get(f"/history?{query}")
    assert resp.status_code == 400
    assert store.history_count() == 1  # table intact
