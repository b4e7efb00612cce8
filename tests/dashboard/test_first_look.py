"""The dashboard a user opens first (issue 58 item 6): the job page leads with state, step, loss by step with
the migrations marked and the last pauses; charts are drawn by training step; the jobs list shows every
state; the history has the pause; a finished job offers no actions; figures that could be misread say what
they are; and a dashboard with no user yet says how to create one."""
from __future__ import annotations

import re
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from dashboard.charts import human_bytes
from dashboard.timeline import timeline
from db import Store
from db.records import StepRecord
from tests.db.seed import T0


def _steps(store: Store, job: int, n: int) -> None:
    for i in range(1, n + 1):
        store.record_step(job, i, 5.0 - 0.1 * i, "pp2tp2dp1")
    store.update_job(job, last_step=n)


def test_charts_are_drawn_by_step_with_each_migration_at_the_step_it_applied_at(store: Store) -> None:
    # the seeded llama: pp2tp2dp2 from T0, a migration T0+100..110 s, pp2tp2dp1 from T0+110 s; here 40 steps
    # reported every 5 s, several at one poll (the same time), and the migration applied at step 20
    steps = [StepRecord(1, i, 5.0 - 0.1 * i, "x", T0 + timedelta(seconds=5 * (i - i % 2))) for i in range(1, 41)]
    maps, (mig,) = store.rank_maps(1), store.recent_migrations(1)
    t = timeline(maps, [replace(mig, at_step=20)], steps, T0 + timedelta(seconds=300))
    assert t.axis == "step"
    left, width = t.loss.left, t.loss.plot_w  # the axis runs from step 1 (reported as the first map began) to 40

    def at(step: float) -> float:
        return pytest.approx(left + width * (step - 1) / 39, abs=0.2)

    assert [x for x, _ in t.loss.lines[0].points] == [at(i) for i in range(1, 41)]  # one point per step
    assert [b.x for b in t.loss.bands] == [at(20)] and "pause 10.25 s" in t.loss.bands[0].label
    # 8 devices from step 1, 4 from the last step reported by the second map's start (T0+110 s: step 23)
    assert [(x, y) for x, y in t.layouts.lines[0].points][1][0] == at(23)
    assert {tick.text for tick in t.loss.x_ticks} >= {"1", "40"}
    assert [x for x, _ in t.rate.lines[0].points] == [at(i) for i in range(6, 41)]  # rate by step too (windows of 5)
    # a job that reports no steps (restart mode) keeps the wall-clock axis, and says so
    assert timeline(maps, [mig], [], T0 + timedelta(seconds=300)).axis == "time"


def test_job_page_leads_with_state_step_loss_and_the_last_pauses(viewer: Any, store: Store) -> None:
    _steps(store, 1, 20)
    for html in (viewer.get("/jobs/1").text, viewer.get("/jobs/1", headers={"HX-Request": "true"}).text):
        assert html.index('id="summary"') < html.index('id="placement"') < html.index('id="fragmentation"')
        summary = html[html.index('id="summary"'):html.index('id="placement"')]
        assert 'id="job-state">running<' in summary and 'id="job-step">20<' in summary
        assert 'id="job-loss">3<' in summary  # the last reported loss, 5.0 - 0.1 * 20
        assert re.search(r'id="summary-loss-chart".*?data-points="20"', summary, re.S)
        assert 'class="band" data-label="#1 pp2tp2dp2→pp2tp2dp1 pause 10.25 s"' in summary
        assert re.search(r'<tr data-migration="1">.*?10\.250 s', summary, re.S)
        assert "x: training step" in summary and "at most one point" not in html
        assert 'id="epoch-hint">Epoch 1: each placement of the job' in html  # what an epoch is


def test_timeline_captions_say_the_axis_is_the_step(viewer: Any, store: Store) -> None:
    _steps(store, 1, 20)
    html = viewer.get("/jobs/1/timeline").text
    assert "Layouts by step" in html and "Loss by step" in html and "one point per committed step" in html
    assert "at most one point per committed step" not in html and 'id="epoch-hint"' in html


def test_a_finished_job_offers_no_actions_and_refuses_them(admin: Any, store: Store) -> None:
    assert "Preempt</button>" in admin.get("/jobs/1").text
    store.set_job_state(1, "finished")
    html = admin.get("/jobs/1").text
    assert 'id="no-actions"' in html and "The job is finished" in html
    assert not any(f"{a.capitalize()}</button>" in html for a in ("preempt", "shrink", "grow", "suspend", "resume"))
    resp = admin.post("/jobs/1/shrink", data={"nodes": "1", "csrf_token": admin.csrf}, headers={"HX-Request": "true"})
    assert resp.status_code == 400 and "is finished, not running: cannot shrink it" in resp.text
    assert store.pending_requests(1) == []


def test_a_suspended_job_offers_resume_only(admin: Any, store: Store) -> None:
    store.set_job_state(1, "suspended")
    html = admin.get("/jobs/1").text
    assert "Resume</button>" in html
    assert not any(f"{a.capitalize()}</button>" in html for a in ("preempt", "shrink", "grow", "suspend"))


def test_the_jobs_list_shows_every_state_by_default(viewer: Any, store: Store) -> None:
    store.set_job_state(2, "finished")
    html = viewer.get("/").text
    assert 'data-job-id="2"' in html and "No jobs match" not in html and "2 jobs, running first" in html
    assert 'data-job-id="2"' not in viewer.get("/?show=active").text


def test_history_has_the_pause_beside_the_duration(viewer: Any) -> None:
    html = viewer.get("/history").text
    assert "<th" in html and "pause (s)" in html and '<td class="pause">10.250</td>' in html
    assert "pause: how long training stood still" in html


def test_migration_page_says_why_bytes_moved_can_exceed_the_state_size(viewer: Any, store: Store) -> None:
    mid = store.start_migration(1, "pp2tp2dp1", "pp2tp2dp2", "resize", {"bytes_state_total": 500_000}, {})
    store.finish_migration(mid, "succeeded", 900_000, 1_500_000, True, {"execute": 0.1})
    html = viewer.get(f"/migrations/{mid}").text
    hint = " ".join(html[html.index('id="bytes-hint"'):].split())
    assert f"state size ({human_bytes(500_000)}, <code>bytes_state_total</code>): one replica" in hint
    assert "Moved can exceed the state size: each data-parallel replica" in hint and "(1 + DP)" in hint


def test_with_no_user_yet_the_login_page_says_how_and_the_server_makes_a_one_off_admin(tmp_path, monkeypatch,
                                                                                        capsys) -> None:
    from dashboard import create_app
    from launcher.cli import main
    from tests.dashboard.conftest import SECRET

    url = f"sqlite:///{tmp_path}/empty.db"
    Store(url).close()
    page = create_app({"DB_URL": url, "SECRET_KEY": SECRET, "TESTING": True}).test_client().get("/login").text
    assert 'id="no-users"' in page and "elastic dashboard --add-user NAME --role admin" in page
    monkeypatch.setenv("ELASTIC_SECRET_KEY", SECRET)
    monkeypatch.setattr("waitress.serve", lambda app, **kw: None)  # start, print, return at once
    assert main(["dashboard", "--db", url]) == 0
    said = re.search(r"log in as admin / (\S+) \(a one-off password", capsys.readouterr().err)
    assert said, "no one-off password printed"
    store = Store(url)
    assert store.verify_user("admin", said.group(1)) is not None and len(store.list_users()) == 1
    store.close()
    page = create_app({"DB_URL": url, "SECRET_KEY": SECRET, "TESTING": True}).test_client().get("/login").text
    assert 'id="no-users"' not in page
    assert main(["dashboard", "--db", url]) == 0 and "no dashboard user yet" not in capsys.readouterr().err
