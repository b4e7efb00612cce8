"""launcher.loop.stall: a job whose steps stop with no known cause is said once, with where the workers
stand, and said again when steps come back (a fake clock, the launcher's poll by hand)."""
from __future__ import annotations

from launcher.loop.stall import STALL_MIN_S, STALL_STEPS, StallWatch


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch():
    said, clock = [], _Clock()
    return StallWatch(said.append, clock), said, clock


def test_nothing_is_said_before_the_first_step_of_a_world_however_long():
    watch, said, clock = _watch()
    clock.now += 10 * STALL_MIN_S
    assert watch.check("w0", None, 0, lambda: "-") is False and said == []


def test_steps_that_stop_are_said_once_after_the_limit_then_their_return():
    watch, said, clock = _watch()
    step, stamp = 0, clock.now
    for _ in range(50):  # 2 s steps, polled every 2 s
        clock.now += 2.0
        step, stamp = step + 1, clock.now
        assert watch.check("w3", stamp, step, lambda: "-") is False
    assert abs(watch.step_s - 2.0) < 1e-9
    limit = max(STALL_MIN_S, STALL_STEPS * 2.0)  # 40 s
    clock.now = stamp + limit - 1
    assert watch.check("w3", stamp, step, lambda: "device 0 50, device 1 49") is False and said == []
    clock.now = stamp + limit + 1
    assert watch.check("w3", stamp, step, lambda: "device 0 50, device 1 49") is True
    assert len(said) == 1 and "no step committed in w3 for 41 s (a step took 2.00 s)" in said[0]
    assert "device 0 50, device 1 49" in said[0]
    clock.now += 100
    assert watch.check("w3", stamp, step, lambda: "-") is True and len(said) == 1  # said once
    assert watch.check("w3", clock.now, step + 1, lambda: "-") is False
    assert len(said) == 2 and said[1].startswith("training goes on: a step committed in w3 after")


def test_fast_steps_still_wait_the_minimum():
    watch, said, clock = _watch()
    for step in range(1, 200):
        clock.now += 0.01
        watch.check("w0", clock.now, step, lambda: "-")
    clock.now += STALL_MIN_S - 1  # 20 typical steps passed long ago, the minimum not yet
    assert watch.check("w0", clock.now - STALL_MIN_S + 1, 199, lambda: "-") is False and said == []
