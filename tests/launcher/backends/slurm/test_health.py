"""Which of a job's nodes are gone (launcher.backends.slurm.health): Slurm's node states, then a one-task
step on the nodes Slurm still calls healthy. The Slurm client here is a stand-in scripted with sinfo's text
(the real one is tested on the testbed: tests/launcher/backends/slurm/test_node_crash.py)."""
from __future__ import annotations

from launcher.backends.slurm.client import SlurmError
from launcher.backends.slurm.commands import build_node_states_command
from launcher.backends.slurm.health import find_gone
from launcher.backends.slurm.parse import parse_node_states

# `sinfo --noheader --Node --nodes=n[1-4] --format="%N %T"` on the testbed: n2 in two partitions, n3's
# slurmd killed (pings unanswered), n4 marked down
SINFO = "n1 allocated\nn2 mixed\nn2 mixed\nn3 allocated*\nn4 down*\n"


def test_node_states_parse_with_the_not_responding_mark() -> None:
    assert parse_node_states(SINFO) == {"n1": ("allocated", True), "n2": ("mixed", True),
                                        "n3": ("allocated", False), "n4": ("down", False)}
    assert build_node_states_command(["n1", "n2", "n3"]) == ["sinfo", "--noheader", "--Node", "--nodes=n[1-3]",
                                                              "--format=%N %T"]


class Slurm:
    def __init__(self, sinfo: str | None, step_fails: dict[str, str]) -> None:
        self.sinfo, self.step_fails, self.probed = sinfo, step_fails, []

    def node_states(self, nodes, max_age=0.0):
        if self.sinfo is None:
            raise SlurmError("reading node states failed: slurmctld busy")
        return parse_node_states(self.sinfo)

    def probe_node(self, job_id, node, timeout, het_group=None):
        self.probed.append((job_id, node, het_group))
        return self.step_fails.get(node)


def test_slurms_word_first_then_a_step_on_the_rest() -> None:
    slurm = Slurm(SINFO, {"n2": "a one-task step on it failed (Communication connection failure)"})
    found = find_gone(slurm, ["n1", "n2", "n3"], lambda n: (17, {"het_group": 1} if n == "n2" else {}))
    assert found == {"n3": "Slurm says it is allocated, not responding",
                     "n2": "a one-task step on it failed (Communication connection failure)"}
    assert sorted(slurm.probed) == [(17, "n1", None), (17, "n2", 1)]  # n3 needed no step; n4 was not asked


def test_the_cheap_look_starts_no_step_and_takes_only_a_node_slurm_calls_down() -> None:
    slurm = Slurm(SINFO, {"n1": "would fail"})
    assert find_gone(slurm, ["n1", "n3", "n4"], None) == {"n4": "Slurm says it is down, not responding"}
    assert slurm.probed == []  # n3's missed pings alone are no crash: a busy slurmd may miss one


def test_without_slurmctlds_answer_the_steps_still_tell() -> None:
    slurm = Slurm(None, {"n2": "a one-task step on it did not end within 15 s"})
    assert find_gone(slurm, ["n1", "n2"], lambda n: (5, {})) == {"n2": "a one-task step on it did not end within 15 s"}
    assert find_gone(slurm, [], lambda n: (5, {})) == {}


def test_the_policy_grows_only_onto_nodes_that_are_free() -> None:
    """sinfo --json recorded on the testbed (tests/dashboard/data/sinfo-plain.json): n1 runs jobs, n2 is
    idle but PLANNED by the backfill scheduler for a pending job, n3 idle in a reservation, n4 idle and
    drained. None of them is free to grow onto; with the flags gone, n2 is."""
    from dataclasses import replace

    from launcher.backends.slurm.health import partition_view
    from launcher.backends.slurm.parse import parse_sinfo_json
    from tests.paths import ROOT

    nodes = parse_sinfo_json((ROOT / "tests" / "dashboard" / "data" / "sinfo-plain.json").read_text())
    assert {n.name: n.flags for n in nodes}["n3"] == ("RESERVED", "PLANNED")

    class Slurm:
        def __init__(self, nodes):
            self.listed = nodes

        def nodes(self, max_age=0.0):
            return self.listed

        def jobs(self, max_age=0.0):
            return []

    assert partition_view(Slurm(nodes), "", own=set()).idle == ()
    freed = [replace(n, flags=()) if n.name == "n2" else n for n in nodes]
    assert partition_view(Slurm(freed), "", own=set()).idle == ("n2",)
