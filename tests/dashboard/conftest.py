"""Fixtures: a seeded database, the app, and logged-in test clients per role."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
from flask import Flask
from flask.testing import FlaskClient

from dashboard import create_app
from db import Store
from tests.db.backends import PgServer
from tests.db.seed import FakeClock, seed_demo

SECRET = "test-secret-key-0123456789abcdef"
PASSWORDS = {"admin": "admin-password", "viewer": "viewer-password"}


def _seed(url: str) -> None:
    """seed_demo on a fake clock and two users (hashing their passwords is most of the ~0.3 s it takes)."""
    clock = FakeClock()
    store = Store(url, clock=clock)
    seed_demo(store, clock)
    store.add_user("admin", PASSWORDS["admin"], "admin")
    store.add_user("viewer", PASSWORDS["viewer"], "viewer")
    store.close()


@pytest.fixture(scope="session")
def seeded_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded SQLite database, built once. Tests never open it: each gets its own copy (db_url)."""
    path = tmp_path_factory.mktemp("seeded") / "dash.db"
    _seed(f"sqlite:///{path}")
    assert [p.name for p in path.parent.iterdir()] == [path.name], "the database is more than its one file"
    return path


@pytest.fixture(scope="session")
def seeded_pg(pg_server: PgServer) -> str:
    """The seeded PostgreSQL database, built once; tests get copies (CREATE DATABASE ... TEMPLATE)."""
    name = f"seeded_dash_{os.getpid()}"
    _seed(pg_server.create_database(name=name))
    return name


@pytest.fixture
def db_url(backend: str, seeded_db: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database of this test's own, a copy of the seeded one (SQLite, or PostgreSQL where the test
    parametrizes `backend`: tests.db.backends.both_backends)."""
    if backend == "sqlite":
        shutil.copyfile(seeded_db, tmp_path / "dash.db")
        yield f"sqlite:///{tmp_path / 'dash.db'}"
        return
    server: PgServer = request.getfixturevalue("pg_server")
    url = server.create_database(template=request.getfixturevalue("seeded_pg"))
    yield url
    server.drop_database(url.rsplit("/", 1)[1])


@pytest.fixture
def app(db_url: str) -> Flask:
    return create_app({"DB_URL": db_url, "SECRET_KEY": SECRET, "TESTING": True})


@pytest.fixture
def store(app: Flask) -> Store:
    return app.extensions["elastic_store"]


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert match, "page has no CSRF token"
    return match.group(1)


def login(client: FlaskClient, role: str) -> str:
    """Log in through the form; returns the session's CSRF token."""
    token = csrf_of(client.get("/login").text)
    resp = client.post("/login", data={"username": role, "password": PASSWORDS[role], "csrf_token": token})
    assert resp.status_code == 302, resp.text
    return csrf_of(client.get("/").text)  # the session's token, as every page carries it


@pytest.fixture
def anon(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def admin(app: Flask) -> Iterator[Any]:
    client = app.test_client()
    client.csrf = login(client, "admin")  # type: ignore[attr-defined]
    yield client


@pytest.fixture
def viewer(app: Flask) -> Iterator[Any]:
    client = app.test_client()
    client.csrf = login(client, "viewer")  # type: ignore[attr-defined]
    yield client
