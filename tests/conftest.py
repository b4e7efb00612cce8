"""Fixtures shared by tests/db and tests/dashboard: the database backends a test runs on.

`backend` is "sqlite" unless a test (or module) parametrizes it over BACKENDS with
`indirect=True` (tests.db.backends.both_backends); `pg_server` is one real PostgreSQL server for the whole session
(tests.db.backends), started on first use. ELASTIC_TEST_POSTGRES=0 skips the postgresql cases
(a machine without the server); otherwise a missing server is installed
(scripts/install-postgres.sh) or, failing that, an error, not a skip.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.db.backends import INSTALL_HINT, PgServer, find_bindir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    if os.environ.get("ELASTIC_TEST_POSTGRES") == "0":
        pytest.skip("ELASTIC_TEST_POSTGRES=0: PostgreSQL cases skipped")
    bindir = find_bindir()
    if bindir is None:  # install it as tests/dashboard/test_browser.py installs Chromium, or fail loudly
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "install-postgres.sh")], capture_output=True,
                              text=True, timeout=1800)
        bindir = find_bindir()
        if bindir is None:
            pytest.fail(f"no PostgreSQL server binaries under /usr/lib/postgresql/*/bin and "
                        f"scripts/install-postgres.sh failed ({proc.returncode}): {proc.stderr.strip()[-2000:]} "
                        f"({INSTALL_HINT}, or set ELASTIC_TEST_POSTGRES=0 to skip these cases)")
    server = PgServer(bindir)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return getattr(request, "param", "sqlite")


@pytest.fixture
def fresh_url(backend: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A URL of an empty database of this test's own on `backend` (dropped after the test)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('fresh') / 'elastic.db'}"
        return
    server: PgServer = request.getfixturevalue("pg_server")
    url = server.create_database()
    yield url
    server.drop_database(url.rsplit("/", 1)[1])
