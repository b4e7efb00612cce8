"""launcher.loop.autoscale: the policy's decision becomes a request from "policy: <why>" in the job's real
database (validated like an admin's), nothing is asked while one is pending, and the cluster is read only
every WATCH_S (a fake backend: its view is what a Slurm partition would say)."""
from __future__ import annotations

from types import SimpleNamespace

from db.store import Store
from launcher.loop.autoscale import WATCH_S, PolicyLoop
from launcher.policy.opportunistic import ClusterView, Pending
from tests.db.seed import layout_entries


class _Backend:
    def __init__(self) -> None:
        self.view, self.reads, self.marks = ClusterView(()), 0, []

    def announce(self, mark: str) -> None:
        self.marks.append(mark)

    def cluster_view(self):
        self.reads += 1
        return self.view


def _loop(tmp_path, policy="opportunistic"):
    store = Store(f"sqlite:///{tmp_path}/e.db", create=True)
    job = store.create_job("j", "pp2tp1dp2", 2, 8, nodes=["n1", "n2"], min_nodes=1)
    store.record_rank_map(job, 0, "pp2tp1dp2", layout_entries(2, 1, 2, ["n1", "n2"], 2))
    opts = SimpleNamespace(min_nodes=1, max_nodes=4, policy_idle=0.0, policy_dwell=0.0, policy_max_per_hour=12,
                           policy_watch=WATCH_S,
                           policy=policy)
    now, said, audit = [0.0], [], []
    backend = _Backend()
    recorder = SimpleNamespace(db=store, job_id=job, audit=lambda a, t: audit.append((a, t)))
    loop = PolicyLoop(opts, backend, recorder, said.append, lambda: now[0])
    return loop, backend, store, job, now, said, audit


def test_a_yield_is_asked_as_a_shrink_from_the_policy_with_its_reason(tmp_path):
    loop, backend, store, job, now, said, audit = _loop(tmp_path)
    backend.view = ClusterView((), (Pending(9, "plain", 1, "Resources"),))
    loop.tick(2)
    (req,) = store.pending_requests(job)
    assert (req.action, req.params["nodes"]) == ("shrink", 1)
    assert req.requested_by == "policy: job 9 (plain) pending for 1 node(s) (Resources), 0 idle: giving 1 back"
    assert said == ["policy: shrink to 1 node(s): job 9 (plain) pending for 1 node(s) (Resources), 0 idle: "
                    "giving 1 back"] and audit[0][0] == "policy"
    now[0] += WATCH_S
    loop.tick(2)  # the request is still pending: nothing more is asked, and the cluster is not even read
    assert len(store.pending_requests(job)) == 1 and backend.reads == 1
    assert backend.marks == ["elastic-launch policy=opportunistic min=1 max=4"]  # told the other jobs once


def test_a_failing_look_is_said_and_the_job_goes_on(tmp_path):
    loop, backend, _store, _job, _now, said, _audit = _loop(tmp_path)
    backend.cluster_view = lambda: 1 / 0
    loop.tick(2)
    assert said == ["policy: looking at the cluster failed (ZeroDivisionError: division by zero); training goes on"]


def test_the_cluster_is_read_once_every_watch_period_and_idle_nodes_are_asked_for(tmp_path):
    loop, backend, store, job, now, said, _audit = _loop(tmp_path)
    backend.view = ClusterView(("n3",))
    loop.tick(2)  # idle from now on (--policy-idle 0): grow
    (req,) = store.pending_requests(job)
    assert (req.action, req.params["nodes"], backend.reads) == ("grow", 3, 1)
    store.complete_request(req.id, "done", "grown")
    now[0] += WATCH_S / 2
    loop.tick(3)
    assert backend.reads == 1 and store.pending_requests(job) == []


def test_each_look_is_recorded_on_the_job_for_the_dashboard(tmp_path):
    loop, backend, store, job, _now, _said, _audit = _loop(tmp_path)
    backend.view = ClusterView(("n4",), (Pending(9, "plain", 2, "Resources"),))
    loop.tick(2)
    record = store.get_job(job)
    assert record.policy == "opportunistic"
    watch = record.policy_watch
    assert (watch["held"], watch["idle"]) == (2, ["n4"]) and watch["at"]
    assert watch["pending"] == [{"job_id": 9, "name": "plain", "nodes": 2, "reason": "Resources"}]
    assert watch["decision"] == {"nodes": 1, "reason": "job 9 (plain) pending for 2 node(s) (Resources), 1 idle: "
                                                       "giving 1 back"}


def test_a_switch_on_the_record_takes_effect_at_the_next_look_and_is_told_to_slurm(tmp_path):
    loop, backend, store, job, now, said, _audit = _loop(tmp_path, policy="manual")
    backend.view = ClusterView(("n3",))
    loop.tick(2)  # manual: the cluster is not even read, nothing told
    assert (backend.reads, backend.marks, store.get_job(job).policy) == (0, [], "manual")
    store.set_policy(job, "opportunistic")  # what the dashboard's switch does
    now[0] += WATCH_S
    loop.tick(2)
    assert backend.reads == 1 and [r.action for r in store.pending_requests(job)] == ["grow"]
    assert backend.marks == ["elastic-launch policy=opportunistic min=1 max=4"]
    assert said[0] == "policy: now opportunistic (switched on the job's record, was manual)"
    store.complete_request(store.pending_requests(job)[0].id, "done", "grown")
    store.set_policy(job, "manual")
    now[0] += WATCH_S
    loop.tick(3)
    assert backend.reads == 1 and store.pending_requests(job) == []  # off again: no look, no request
    assert backend.marks[-1] == "elastic-launch policy=manual min=1 max=4"  # the others stop counting it
