"""elastic bench-policy's pure parts: the trace is the same for a seed and within its bounds; utilisation and
waits from queue samples against counts worked out by hand; the goals read the figures as the issue states."""
from __future__ import annotations

import pytest

from launcher.policybench.measure import Sample, sample_steps, utilisation, wait_figures, waits
from launcher.policybench.replay import RunResult, plain_script
from launcher.policybench.report import describe, goals
from launcher.policybench.trace import FIRST_AT_S, RUN_S, make_trace


def test_a_seed_gives_the_same_trace_and_another_seed_another():
    a, b = make_trace(1, 600), make_trace(1, 600)
    assert a == b and make_trace(2, 600) != a
    assert all(FIRST_AT_S <= j.at_s < 600 and 1 <= j.nodes <= 3 and RUN_S[0] <= j.run_s <= RUN_S[1] for j in a)
    assert [j.at_s for j in a] == sorted(j.at_s for j in a) and [j.index for j in a] == list(range(len(a)))
    assert all(j.nodes == 1 for j in make_trace(1, 600, max_nodes=1))
    assert "--nodes=2 --exclusive --job-name=bench-plain-7" in plain_script(a[0].__class__(7, 0.0, 2, 30.0))


def test_utilisation_is_the_time_average_of_allocated_nodes():
    # 0-10 s: 1 node of 4; 10-30 s: 4 (capped: 5 listed); 30-40 s: 2 -> (10*1 + 20*4 + 10*2) / (4*40)
    samples = [Sample(0, {1: 1}), Sample(10, {1: 1, 2: 4}), Sample(30, {1: 2}), Sample(40, {1: 2})]
    assert utilisation(samples, 4, 0, 40) == pytest.approx((10 + 80 + 20) / 160)
    assert utilisation(samples, 4, 10, 30) == pytest.approx(1.0)
    assert utilisation(samples[:1], 4, 0, 40) == 0.0


def test_waits_are_from_submission_to_first_seen_running():
    samples = [Sample(5, {1: 1}), Sample(6, {1: 1, 7: 2}), Sample(20, {9: 1})]
    w = waits({7: 1.5, 9: 3.0, 11: 4.0}, samples)
    assert w == {7: 4.5, 9: 17.0, 11: None}
    f = wait_figures(w)
    assert (f.median_s, f.max_s, f.never_started) == (10.8, 17.0, 1)


def test_replica_steps_count_each_step_once_per_dp_replica():
    rows = [(1, 5.0, "pp2tp1dp1"), (2, 4.9, "pp2tp1dp3"), (3, 4.8, "pp2tp1dp2")]
    assert sample_steps(rows) == (3, 6) and sample_steps([]) == (0, 0)


def _run(policy, util, median, resizes=()):
    return RunResult(policy, 100.0, util, {1: median}, median, median, 0, 10, 10, True, list(resizes))


def test_the_goals_as_the_issue_states_them():
    ok = {"from_layout": "pp2dp4", "to_layout": "pp2dp3", "status": "succeeded", "bit_exact": True, "pause_s": 0.3,
          "duration_s": 2.0, "bytes_moved": 1}
    met = goals(_run("manual", 0.40, 10.0), _run("opportunistic", 0.70, 11.5, [ok]))
    assert met == {"utilisation +25 points": True, "plain median wait no longer": True, "every step once": True,
                   "resizes succeeded, bit-exact": True}
    # 1.5 s longer than manual is within one yield's duration (2.0 s); 3 s is not; 20 points are too few
    met = goals(_run("manual", 0.40, 10.0), _run("opportunistic", 0.60, 13.0, [{**ok, "bit_exact": False}]))
    assert not any(met[k] for k in ("utilisation +25 points", "plain median wait no longer",
                                    "resizes succeeded, bit-exact"))
    assert describe([_run("manual", 0.4, 10.0)])[1].startswith("manual          40.0%")
