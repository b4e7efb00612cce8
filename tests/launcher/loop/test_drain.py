"""launcher.loop.drain: which of a job's nodes to leave when the cluster drains them (a fake cluster's answer
and clock; the live shrink itself is tested on the Slurm testbed, tests/launcher/backends/slurm/test_drain.py)."""
from __future__ import annotations

from launcher.loop.drain import WATCH_S, DrainWatch


class _Cluster:
    def __init__(self) -> None:
        self.drained: dict[str, str] = {}
        self.asked = 0

    def __call__(self, nodes):
        self.asked += 1
        return {n: w for n, w in self.drained.items() if n in nodes}


def _watch():
    cluster, said, now = _Cluster(), [], [0.0]
    return DrainWatch(cluster, said.append, lambda: now[0]), cluster, said, now


def test_the_cluster_is_asked_once_every_watch_period():
    watch, cluster, _said, now = _watch()
    for _ in range(5):
        assert watch.due(["n1", "n2"], 1, "n1") == {}
        now[0] += WATCH_S / 5
    assert cluster.asked == 1
    now[0] += WATCH_S
    watch.due(["n1", "n2"], 1, "n1")
    assert cluster.asked == 2


def test_a_drained_node_is_left_while_the_job_keeps_its_minimum():
    watch, cluster, said, now = _watch()
    cluster.drained = {"n3": "Slurm says it is draining", "n4": "Slurm says it is drained"}
    assert watch.due(["n1", "n2", "n3", "n4"], 3, "n1") == {"n3": "Slurm says it is draining"}
    assert said == ["n4 is drained by the cluster (Slurm says it is drained), but the job keeps it: the job is at "
                    "its minimum of 3 node(s)"]
    now[0] += WATCH_S
    assert watch.due(["n1", "n2", "n4"], 3, "n1") == {}
    assert len(said) == 1  # said once


def test_the_batch_node_is_never_left():
    watch, cluster, said, _now = _watch()
    cluster.drained = {"n1": "Slurm says it is draining"}
    assert watch.due(["n1", "n2"], 1, "n1") == {}
    assert said and "it runs the batch step" in said[0]
