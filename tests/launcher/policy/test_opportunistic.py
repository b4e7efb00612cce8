"""launcher.policy.opportunistic: grow into idle nodes, yield to a pending job, never thrash (a fake clock and
cluster views written by hand)."""
from __future__ import annotations

from launcher.backends.slurm.parse import JobInfo
from launcher.policy.opportunistic import ClusterView, OpportunisticPolicy, Pending, pending_view
from launcher.policy.peers import Peer, companion_mark, policy_mark


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


def J(job_id, state, num_nodes, reason="Resources", name="j", comment="", priority=0, submit_time=0):  # noqa: N802
    return JobInfo(job_id, state, [], None, num_nodes, name, reason, comment=comment, priority=priority,
                   submit_time=submit_time)


def test_the_view_keeps_pending_jobs_in_order():
    view = pending_view(["n2"], [J(3, "RUNNING", 2), J(4, "PENDING", 2), J(5, "PENDING", 0, "Priority")])
    assert view == ClusterView(("n2",), (Pending(4, "j", 2, "Resources"), Pending(5, "j", 1, "Priority")))


def test_the_view_reads_the_elastic_jobs_marks_and_leaves_their_companions_out_of_the_pending():
    view = pending_view([], [
        J(10, "RUNNING", 1, comment=policy_mark("opportunistic", 1, 4), priority=5, submit_time=100),
        J(11, "RUNNING", 2, comment=companion_mark(10)),  # 10's grow that started: its nodes are 10's
        J(12, "PENDING", 1, comment=companion_mark(10)),  # 10's grow waiting: not work to yield to
        J(20, "RUNNING", 3, comment=policy_mark("manual", 1, 4)),  # manual: never yields, not a peer
        J(21, "RUNNING", 2, comment="a user's own comment"),
        J(30, "PENDING", 2, name="plain"),
        J(40, "PENDING", 1), J(41, "RUNNING", 1, comment=policy_mark("opportunistic", 1, 2))])
    assert [p.job_id for p in view.pending] == [30, 40]
    assert view.peers == (Peer(10, 3, 1, 4, 5, 100), Peer(41, 1, 1, 2))
    own = pending_view([], [J(12, "PENDING", 1), J(30, "PENDING", 2)], own=(12,))
    assert [p.job_id for p in own.pending] == [30]


def test_pending_jobs_are_taken_in_slurms_priority_order_not_squeues_listing():
    view = pending_view([], [J(5, "PENDING", 1, priority=10, submit_time=3), J(6, "PENDING", 3, priority=90),
                             J(7, "PENDING", 2, priority=10, submit_time=1)])
    assert [p.job_id for p in view.pending] == [6, 7, 5]  # the yield is for job 6, the one Slurm starts next


def _jobs(n: int, held: list[int], lo: int = 1, hi: int = 4) -> list[Peer]:
    """n opportunistic elastic jobs, job i (id 100 + i) submitted at time i, all of priority 7."""
    return [Peer(100 + i, held[i], lo, hi, 7, i) for i in range(n)]


def _decisions(peers: list[Peer], view: ClusterView, clock_at: float = 1000.0) -> dict[int, int]:
    """What each job's own policy decides from the same view: job id -> node count asked (held: no change)."""
    out = {}
    for p in peers:
        clock = _Clock()
        policy = OpportunisticPolicy(p.min_nodes, p.max_nodes, idle_s=30, dwell_s=60, clock=clock, me=p.job_id)
        policy.decide(p.nodes, view)  # idle since now
        clock.now = clock_at
        d = policy.decide(p.nodes, ClusterView(view.idle, view.pending, tuple(peers)))
        out[p.job_id] = d.nodes if d else p.nodes
    return out


def test_n_elastic_jobs_yield_exactly_what_one_pending_job_lacks_youngest_first():
    peers = _jobs(3, [3, 3, 2])  # 5 nodes above their minimum of 1
    view = ClusterView((), (Pending(9, "plain", 3, "Resources"),))
    got = _decisions(peers, view)
    # the newest (102) gives its 1 above MIN, then 101 gives 2: 3 in all, the oldest keeps its nodes
    assert got == {100: 3, 101: 1, 102: 1}
    assert sum(p.nodes for p in peers) - sum(got.values()) == 3


def test_a_lower_priority_job_yields_before_a_younger_one():
    peers = [Peer(100, 3, 1, 4, 1, 0), Peer(101, 3, 1, 4, 9, 5)]  # 100 is older but of lower priority
    got = _decisions(peers, ClusterView((), (Pending(9, "plain", 2, "Resources"),)))
    assert got == {100: 1, 101: 3}


def test_nobody_yields_when_all_together_cannot_make_up_the_shortfall():
    peers = _jobs(2, [2, 2])  # 2 above MIN in all
    assert _decisions(peers, ClusterView(("n9",), (Pending(9, "plain", 4, "Resources"),))) == {100: 2, 101: 2}


def test_idle_nodes_are_shared_out_oldest_first_never_twice():
    peers = _jobs(3, [1, 3, 1])  # rooms 3, 1, 3
    got = _decisions(peers, ClusterView(("a", "b", "c", "d", "e")))
    assert got == {100: 4, 101: 4, 102: 2}  # 3 + 1 + 1 = the 5 idle nodes, none taken twice


def test_a_job_alone_decides_as_before_with_or_without_its_own_mark():
    alone = _decisions([Peer(100, 2, 1, 4)], ClusterView(("a",), (Pending(9, "p", 2, "Resources"),)))
    assert alone == {100: 1}
    policy, clock = _policy()  # no job id, no peers: the single-job rules
    policy.decide(2, ClusterView(("a",)))
    clock.now = 31
    assert policy.decide(2, ClusterView(("a",))).nodes == 3
