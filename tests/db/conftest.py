"""Fixtures: a fresh store per test (SQLite on disk, or a database of its own on the session's real
PostgreSQL server where the test parametrizes `backend`, see tests/conftest.py), with a settable clock."""
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
def store_url(backend: str, db_path: Path, request: pytest.FixtureRequest) -> str:
    """The URL `store` opens: db_path on SQLite, else a fresh PostgreSQL database."""
    return f"sqlite:///{db_path}" if backend == "sqlite" else request.getfixturevalue("fresh_url")


@pytest.fixture
def store(store_url: str, clock: FakeClock) -> Iterator[Store]:
    s = Store(store_url, clock=clock)
    yield s
    s.close()


@pytest.fixture
def url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A seeded database (tests.db.seed.seed_demo) for CLI tests."""
    u = f"sqlite:///{tmp_path / 'cli.db'}" if backend == "sqlite" else request.getfixturevalue("fresh_url")
    clock = FakeClock()
    s = Store(u, clock=clock)
    seed_demo(s, clock)
    s.close()
    return u
