"""A job's timeline: layouts over time, migrations with their pause (or duration when no pause was
measured), step rate and loss from the steps the workers reported."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest

from dashboard.timeline import step_rates, timeline
from db import Store
from db.records import StepRecord
from tests.db.seed import T0


def test_step_rate_of_evenly_spaced_steps_is_their_inverse_spacing() -> None:
    steps = [StepRecord(1, i, 1.0, "pp1tp1dp1", T0 + timedelta(seconds=0.25 * i)) for i in range(20)]
    rates = step_rates(steps, window=4)
    assert len(rates) == 16 and all(r == pytest.approx(4.0) for _, r in rates)
    # a handful of reports (a launcher polling slower than the steps): rates between consecutive ones
    assert step_rates(steps[:3], window=4) == [(1.0, 4.0), (2.0, 4.0)]  # by step (the charts' axis)
    assert step_rates(steps[:1]) == []


def test_many_short_migrations_get_labels_that_never_overlap() -> None:
    """Twenty migrations a few pixels apart (a demo's or a policy's quick resizes): every label written is
    clear of the others in its row, the whole label where it fits, its "#id" where only that fits, none
    where neither does (each band keeps the whole label as its tooltip); a lone band gets its whole label."""
    from dashboard.linechart import CHAR_PX, line_chart

    label = "#{} pp2tp2dp1→pp2tp1dp1 pause 0.06 s"
    bands = [(10.0 * i, 10.0 * i + 0.5, label.format(i), "#f59e0b", "") for i in range(20)]
    chart = line_chart([("x", "#000", [(0.0, 1.0), (200.0, 2.0)])], bands)
    written = [b for b in chart.bands if b.text]
    assert len(chart.bands) == 20 and written and written[0].text == label.format(0)
    for row in {b.row for b in written}:
        spans = sorted((b.x + 2, b.x + 2 + len(b.text) * CHAR_PX) for b in written if b.row == row)
        assert all(a_end + 4 <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
    assert {b.text for b in written} - {label.format(i) for i in range(20)} <= {f"#{i}" for i in range(20)}
    assert all(b.label == label.format(i) for i, b in enumerate(chart.bands))
    lone = line_chart([("x", "#000", [(0.0, 1.0), (200.0, 2.0)])], bands[:1])
    assert lone.bands[0].text == label.format(0) and lone.bands[0].row == 0


def test_timeline_page_draws_layouts_migrations_rate_and_loss(admin, store: Store) -> None:
    # the seeded llama: pp2tp2dp2 at t=0, migration t=100..110, pp2tp2dp1 from t=110; 20 reported steps
    for i in range(1, 21):
        store.record_step(1, i, 5.0 - 0.1 * i, "pp2tp2dp1")  # the app's clock: real time, after the seed
    page = admin.get("/jobs/1/timeline")
    assert page.status_code == 200
    html = page.text
    assert html.count('class="band"') == 3  # the one migration, on each of the three charts
    assert "pp2tp2dp2→pp2tp2dp1 pause 10.25 s" in html and 'data-what="pause"' in html  # the seed's pause_s
    assert re.search(r'id="loss-chart".*?data-points="20"', html, re.S)
    assert re.search(r'id="rate-chart".*?data-points="15"', html, re.S)  # windows of 5 over 20 steps
    assert 'data-epoch="0"' in html and 'data-epoch="1"' in html
    # a migration without a measured pause shows its duration, and says so
    mid = store.start_migration(1, "pp2tp2dp1", "pp1tp2dp1", "resize", {}, {})
    store.finish_migration(mid, "succeeded", 1, 2, True, {"execute": 0.1})
    html = admin.get("/jobs/1/timeline", headers={"HX-Request": "true"}).text
    assert "<html" not in html and html.count('class="band"') == 6
    assert f'<tr data-migration="{mid}">' in html and 'data-what="duration"' in html and "pause not measured" in html
    assert 'href="/jobs/1/timeline"' in admin.get("/jobs/1").text


def test_timeline_geometry_shares_one_time_axis(store: Store) -> None:
    maps, migs = store.rank_maps(1), store.recent_migrations(1)
    t = timeline(maps, migs, [], maps[-1].started_at + timedelta(seconds=90))
    assert t.layouts.lines[0].points[0][0] == t.layouts.left  # the first epoch starts the axis
    band = t.layouts.bands[0]
    # the migration ran 100..110 s on a 0..200 s axis
    assert band.x == pytest.approx(t.layouts.left + t.layouts.plot_w * 0.5, abs=0.2)
    assert band.width == pytest.approx(t.layouts.plot_w * 0.05, abs=0.2)
    assert t.rate.empty is False and t.loss.lines[0].points == ()
    assert [p[1] for p in t.layouts.lines[0].points][0] < [p[1] for p in t.layouts.lines[0].points][-1]  # 8 -> 4 devices
