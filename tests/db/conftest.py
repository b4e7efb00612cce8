"""Fixtures: a fresh SQLite store on disk per test, with a settable clock."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from db import Store
from tests.db.seed import FakeClock


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
