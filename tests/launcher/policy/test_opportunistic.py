"""launcher.policy.opportunistic: grow into idle nodes, yield to a pending job, never thrash (a fake clock and
cluster views written by hand)."""
from __future__ import annotations

from launcher.policy.opportunistic import ClusterView, OpportunisticPolicy, Pending, pending_view


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _policy(**kw):
    clock = _Clock()
    return OpportunisticPolicy(1, 4, clock=clock, **{"idle_s": 30, "dwell_s": 60, "max_per_hour": 12, **kw}), clock


def test_idle_nodes_are_grown_onto_only_after_they_stayed_idle():
    policy, clock = _policy()
    view = ClusterView(("n3", "n4"))
    assert policy.decide(2, view) is None  # idle since now
    clock.now = 29
    assert policy.decide(2, view) is None
    clock.now = 31
    d = policy.decide(2, view)
    assert d.nodes == 4 and "2 node(s) idle for 31 s (n3, n4) and no job pending" in d.reason


def test_growth_stops_at_max_and_idle_time_restarts_when_nodes_get_busy():
    policy, clock = _policy()
    policy.decide(3, ClusterView(("n4", "n5")))
    clock.now = 20
    policy.decide(3, ClusterView(()))  # busy again: the idle clock restarts
    clock.now = 40
    assert policy.decide(3, ClusterView(("n4", "n5"))) is None
    clock.now = 71
    assert policy.decide(3, ClusterView(("n4", "n5"))).nodes == 4  # --nnodes MAX


def test_a_pending_job_gets_exactly_what_it_lacks_at_once_and_never_below_min():
    policy, clock = _policy()
    job = Pending(17, "plain", 2, "Resources")
    d = policy.decide(3, ClusterView(("n4",), (job,)))
    assert d.nodes == 2 and d.reason == "job 17 (plain) pending for 2 node(s) (Resources), 1 idle: giving 1 back"
    assert policy.decide(2, ClusterView(("n4", "n3"), (job,))) is None  # it can start now
    big = Pending(18, "big", 4, "Resources")
    assert policy.decide(2, ClusterView((), (big,))) is None  # 4 > what is idle plus what is above MIN (1)
    held = Pending(19, "held", 1, "JobHeldUser")
    assert policy.decide(2, ClusterView((), (held,))) is None  # not waiting for nodes


def test_a_yield_does_not_wait_for_the_dwell_and_the_hourly_bound_holds():
    policy, clock = _policy(max_per_hour=2)
    assert policy.decide(2, ClusterView(("n3",), (Pending(5, "p", 1, "Priority"),))) is None  # it fits the idle one
    clock.now = 10
    assert policy.decide(2, ClusterView(())) is None  # it started there: the idle clock stops
    clock.now = 20
    assert policy.decide(2, ClusterView(("n3",))) is None  # idle again from now
    clock.now = 51
    assert policy.decide(2, ClusterView(("n3",))).nodes == 3
    clock.now = 60  # 9 s after the grow, a job waits: the yield comes at once
    assert policy.decide(3, ClusterView((), (Pending(6, "q", 1, "Resources"),))).nodes == 2
    clock.now = 100
    assert policy.decide(2, ClusterView(("n3",))) is None
    clock.now = 200
    assert policy.decide(2, ClusterView(("n3",))) is None  # idle 100 s, dwell passed, but 2 resizes this hour
    clock.now = 51 + 3600  # the grow at 51 is an hour old: one resize in the last hour
    assert policy.decide(2, ClusterView(("n3",))).nodes == 3


def test_the_view_keeps_pending_jobs_in_order():
    class J:
        def __init__(self, job_id, state, num_nodes, reason="Resources", name="j"):
            self.job_id, self.state, self.num_nodes, self.reason, self.name = job_id, state, num_nodes, reason, name

    view = pending_view(["n2"], [J(3, "RUNNING", 2), J(4, "PENDING", 2), J(5, "PENDING", 0, "Priority")])
    assert view == ClusterView(("n2",), (Pending(4, "j", 2, "Resources"), Pending(5, "j", 1, "Priority")))
