"""launcher.runtime.overhead: the runtime's share of steady-state steps, summed by hand here."""
from __future__ import annotations

import json

from launcher.runtime.overhead import StepCost


def test_only_steps_without_an_event_count_and_each_takes_its_boundary_and_vote(tmp_path):
    cost = StepCost(str(tmp_path))
    cost.boundary(0.0, 1.0, steady=True)  # the first boundary: step 1 begins at 1.0
    cost.voted(0.1)
    cost.boundary(2.0, 2.2, steady=True)  # step 1: 1.0 -> 2.2, runtime 0.2 + 0.1
    cost.voted(0.1)
    cost.boundary(3.0, 5.0, steady=False)  # an event applied here: step 2 is a pause, not counted
    cost.voted(0.05)
    cost.boundary(6.0, 6.1, steady=True)  # step 3 began at the end of the event: not counted either
    cost.voted(0.05)
    cost.boundary(7.0, 7.1, steady=True)  # step 4: 6.1 -> 7.1, runtime 0.1 + 0.05
    assert [round(x, 9) for x in cost.wall] == [1.2, 1.0]
    assert [round(x, 9) for x in cost.boundary_s] == [0.2, 0.1] and cost.vote_s == [0.1, 0.05]
    cost.write(3)
    assert json.loads((tmp_path / "dev3.json").read_text())["vote_s"] == [0.1, 0.05]


def test_nothing_is_written_without_a_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("ELASTIC_RUNTIME_STATS", raising=False)
    StepCost().write(0)
    assert list(tmp_path.iterdir()) == []
