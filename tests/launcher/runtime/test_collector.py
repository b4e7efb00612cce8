"""launcher.runtime.collector.CollectorHold in this process: the objects alive at hold() leave the collector's reach
until release(), a second hold or release changes nothing, and a script that manages the collector itself
(disabled it, or froze objects) is left alone. The live check (a worker's first step after a migration
held, every other step not) is tests/examples/test_gpt_runtime.py."""
from __future__ import annotations

import gc

import pytest

from launcher.runtime.collector import CollectorHold


@pytest.fixture(autouse=True)
def _collector_restored():
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable()


def test_hold_freezes_what_is_alive_and_release_hands_it_back() -> None:
    hold, alive = CollectorHold(), [[i] for i in range(1000)]
    hold.hold()
    frozen = gc.get_freeze_count()
    assert frozen >= len(alive) and hold.held
    hold.hold()
    assert gc.get_freeze_count() == frozen
    hold.release()
    assert gc.get_freeze_count() == 0 and not hold.held
    hold.release()
    assert gc.get_freeze_count() == 0


def test_a_script_that_froze_objects_itself_keeps_them_frozen() -> None:
    gc.freeze()
    mine = gc.get_freeze_count()
    hold = CollectorHold()
    hold.hold()
    hold.release()
    assert gc.get_freeze_count() == mine and not hold.held


def test_a_disabled_collector_is_left_alone() -> None:
    gc.disable()
    hold = CollectorHold()
    hold.hold()
    assert gc.get_freeze_count() == 0 and not hold.held
    hold.release()
    assert not gc.isenabled()
