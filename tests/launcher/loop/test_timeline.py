"""Where a pause goes (launcher.loop.timeline): worker marks laid against the pause, by hand-computed numbers."""
from __future__ import annotations

from launcher.loop.timeline import build, explain

T0 = 1000.0  # the old layout's last commit (wall time)


def _timeline():
    # devices 0, 1 train on the old layout; 1 leaves, 2 joins; the new layout's first step commits at T0 + 5
    marks = {
        0: {"voted": T0 - 0.2, "boundary": T0 + 0.1, "met m3": T0 + 0.5, "formed m3": T0 + 0.7, "moved": T0 + 2.0,
            "agreed": T0 + 2.1, "formed w3": T0 + 2.4, "built": T0 + 2.6},
        1: {"voted": T0 - 0.1, "boundary": T0 + 0.4, "met m3": T0 + 0.5, "formed m3": T0 + 0.6, "moved": T0 + 2.5,
            "agreed": T0 + 2.6},
        2: {"voted": T0 - 50.0, "boundary": T0 - 9.0, "met m3": T0 + 0.5, "formed m3": T0 + 0.8, "moved": T0 + 1.0,
            "agreed": T0 + 2.6, "formed w3": T0 + 2.9, "built": T0 + 3.0},
    }
    first = {0: {"voted": T0 + 4.9, "committed": T0 + 5.0}, 2: {"voted": T0 + 4.0, "committed": T0 + 5.0}}
    return build(T0, T0 + 5.0, marks, first, "w1", "w3", 3, (0, 1), (2, 0))


def test_rows_are_seconds_after_the_last_old_commit_and_say_who_is_who() -> None:
    tl = _timeline()
    assert tl.pause_s == 5.0
    assert tl.roles == {0: "0->1", 1: "1->-", 2: "-->0"}
    assert abs(tl.rows[0]["boundary"] - 0.1) < 1e-9 and abs(tl.rows[0]["1st vote"] - 4.9) < 1e-9
    assert "voted" not in tl.rows[2]  # a joiner's vote marks belong to no step of the old layout
    assert "formed w" not in tl.rows[1]  # the leaving device trains on no new world


def test_the_critical_path_follows_the_last_worker_and_adds_up_to_the_pause() -> None:
    path = _timeline().critical_path()
    # the last worker to reach each stage: boundary 0.4, met 0.5, formed m 0.8, moved 2.5, agreed 2.6,
    # formed w 2.9, built 3.0, first vote 4.9, first commit 5.0
    want = {"boundary": 0.4, "met m": 0.1, "formed m": 0.3, "moved": 1.7, "agreed": 0.1, "formed w": 0.3,
            "built": 0.1, "1st vote": 1.9, "1st commit": 0.1}
    assert path.keys() == want.keys()
    for k, v in want.items():
        assert abs(path[k] - v) < 1e-9, k
    assert abs(sum(path.values()) - 5.0) < 1e-9
    assert "critical path" in explain(_timeline())
