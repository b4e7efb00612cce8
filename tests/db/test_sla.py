"""GPU-fraction SLA math (ideal time on max devices / real time)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from db import Store
from db.sla import gpu_fraction
from tests.db.seed import T0, FakeClock, layout_entries, seed_demo


def t(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def test_full_allocation_without_migrations_is_one() -> None:
    assert gpu_fraction([(t(0), None, 8)], [], 8, t(100)) == 1.0


def test_half_the_devices_half_the_time() -> None:
    # 100 s on 8 of 8, then 100 s on 4 of 8: ideal 150 s / real 200 s.
    assert gpu_fraction([(t(0), t(100), 8), (t(100), None, 4)], [], 8, t(200)) == 0.75


def test_migration_time_is_lost_and_overlaps_count_once() -> None:
    sla = gpu_fraction([(t(0), None, 8)], [(t(10), t(20)), (t(15), t(25))], 8, t(100))
    assert abs(sla - 0.85) < 1e-9  # type: ignore[operator]


def test_running_migration_and_gaps_are_lost() -> None:
    assert gpu_fraction([(t(0), t(50), 4)], [], 4, t(100)) == 0.5  # gap after the epoch
    assert gpu_fraction([(t(0), None, 4)], [(t(50), None)], 4, t(100)) == 0.5  # still migrating


def test_nothing_to_measure() -> None:
    assert gpu_fraction([], [], 8, t(10)) is None
    assert gpu_fraction([(t(0), None, 8)], [], 8, t(0)) is None


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 16)), min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 200)), max_size=4), st.integers(1, 16))
def test_sla_is_a_fraction(epochs, migs, max_devices) -> None:  # type: ignore[no-untyped-def]
    starts = sorted({s for s, _ in epochs})
    devices = dict(epochs)
    spans = [(t(s), t(n) if n else None, devices[s]) for s, n in zip(starts, [*starts[1:], 0])]
    sla = gpu_fraction(spans, [(t(s), t(s + d)) for s, d in migs], max_devices, t(1001))
    assert sla is not None and 0.0 <= sla <= 1.0


def test_store_sla_from_recorded_epochs(store: Store, clock: FakeClock) -> None:
    ids = seed_demo(store, clock)
    # epoch 0: 8/8 devices for 110 s, of which 10 s migrating; epoch 1: 4/8 for 90 s.
    assert abs(store.gpu_fraction_sla(ids["llama"]) - (800 + 360) / 8 / 200) < 1e-9  # type: ignore[operator]
    assert store.gpu_fraction_sla(ids["bert"]) == 1.0
    overview = {r["job"].name: r for r in store.jobs_overview()}
    assert overview["llama"]["sla_target"] == 0.95 and overview["llama"]["sla_ok"] is False
    assert overview["bert"]["sla_ok"] is True and overview["llama"]["devices_held"] == 4


def test_finished_job_stops_the_clock(store: Store, clock: FakeClock) -> None:
    jid = store.create_job("done", "pp1tp1dp1", 1, 2)
    store.record_rank_map(jid, 0, "pp1tp1dp1", layout_entries(1, 1, 1, ["n"], 1))
    clock.advance(100)
    store.set_job_state(jid, "finished")
    clock.advance(1000)
    assert store.gpu_fraction_sla(jid) == 0.5
    assert store.gpu_fraction_sla(store.create_job("new", "x", 1, 1)) is None
    assert gpu_fraction([(T0, None, 1)], [], 1, datetime(2030, 1, 1, tzinfo=timezone.utc)) == 1.0
