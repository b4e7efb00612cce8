"""history()/history_count() filters and the shared text-filter parser."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from db import Store
from db.filters import parse_history_filters
from tests.db.backends import both_backends
from tests.db.seed import T0, FakeClock


@pytest.fixture
def migrations(store: Store, clock: FakeClock) -> dict[str, int]:
    a = store.create_job("a", "pp1tp1dp1", 1, 2)
    b = store.create_job("b", "pp1tp1dp1", 1, 2)
    plan = [(a, "resize", "succeeded"), (a, "preempt", "failed"), (b, "signal", "succeeded"), (b, "demo", "running")]
    for i, (job, trigger, status) in enumerate(plan):
        clock.t = T0 + timedelta(days=i)
        mid = store.start_migration(job, "x", "y", trigger, {}, {})
        if status != "running":
            store.finish_migration(mid, status, 10, 20, status == "succeeded", {"execute": 1.0},
                                   error=None if status == "succeeded" else "boom")
    return {"a": a, "b": b}


@both_backends
def test_filters(store: Store, migrations: dict[str, int]) -> None:
    assert [r["trigger"] for r in store.history()] == ["demo", "signal", "preempt", "resize"]  # newest first
    assert store.history_count() == 4
    assert {r["job_name"] for r in store.history(job=migrations["a"])} == {"a"}
    assert store.history_count(job="b") == 2
    assert [r["trigger"] for r in store.history(status="failed")] == ["preempt"]
    assert store.history(trigger="signal")[0]["bit_exact"] is True
    assert store.history_count(since=T0 + timedelta(days=1), until=T0 + timedelta(days=2)) == 2
    assert [r["trigger"] for r in store.history(limit=2, offset=1)] == ["signal", "preempt"]
    assert store.history(status="running")[0]["finished_at"] is None


@both_backends
def test_parse_filters_from_text(store: Store, migrations: dict[str, int]) -> None:
    f = parse_history_filters({"job": "a", "since": "2024-05-02", "until": "2024-05-02", "trigger": "", "status": None})
    assert f.since == datetime(2024, 5, 2, tzinfo=timezone.utc)
    assert f.until is not None and f.until.date().isoformat() == "2024-05-02" and f.until.hour == 23
    assert [r["trigger"] for r in store.history(**f.as_kwargs())] == ["preempt"]
    assert parse_history_filters({"job": "7"}).job == 7


@pytest.mark.parametrize("raw, match", [
    ({"since": "yesterday"}, "bad time"),
    ({"until": "2024-13-45"}, "bad time"),
    ({"trigger": "'; DROP TABLE migrations; --"}, "bad trigger"),
    ({"status": "ok"}, "bad status"),
    ({"since": "2024-05-03", "until": "2024-05-01"}, "after"),
    ({"job": "x" * 300}, "too long"),
])
def test_malformed_filters_are_rejected(raw: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_history_filters(raw)


@both_backends
def test_store_rejects_unknown_vocabulary(store: Store) -> None:
    with pytest.raises(ValueError):
        store.history(trigger="nope")
    with pytest.raises(ValueError):
        store.history(job=1.5)  # type: ignore[arg-type]
