"""Fixtures: a fresh SQLite store on disk per test, with a settable clock."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from db import Store
from tests.db.seed import FakeClock, seed_demo


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "elastic.db"


@pytest.fixture
def store(db_path: Path, clock: FakeClock) -> Iterator[Store]:
    s = Store(f"sqlite:///{db_path}", clock=clock)
    yield s
    s.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A seeded database (tests.db.seed.seed_demo) for CLI tests."""
    u = f"sqlite:///{tmp_path / 'cli.db'}"
    clock = FakeClock()
    s = Store(u, clock=clock)
    seed_demo(s, clock)
    s.close()
    return u
