"""Schema creation, WAL mode, versioning and the upgrade path from v1."""
from __future__ import annotations

import sqlite3
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect
from sqlalchemy.exc import OperationalError

from db import DatabaseError, Store
from db.models import Base
from db.schema import CURRENT_VERSION, create_v1
from tests.db.backends import both_backends


def _columns(path: Path) -> dict[str, set[str]]:
    insp = inspect(create_engine(f"sqlite:///{path}"))
    return {t: {c["name"] for c in insp.get_columns(t)} for t in insp.get_table_names()}


def _upgraded(old: Path, found: int) -> Store:
    """Open the database at schema `found`, which upgrades it: it says it found `found` and is current now."""
    store = Store(f"sqlite:///{old}")
    assert (store.schema_found, store.schema_version) == (found, CURRENT_VERSION) and CURRENT_VERSION > found
    return store


def _same_columns_as_fresh(store: Store, old: Path, tmp_path: Path) -> None:
    """Close the upgraded `store`; its file has the columns a database created fresh has."""
    store.close()
    fresh = tmp_path / "fresh.db"
    Store(f"sqlite:///{fresh}").close()
    assert _columns(old) == _columns(fresh)


def test_fresh_database_has_every_table_and_current_version(store: Store, db_path: Path) -> None:
    cols = _columns(db_path)
    assert set(Base.metadata.tables) <= set(cols)
    for name in ("jobs", "nodes", "devices", "rank_maps", "rank_map_entries", "migrations",
                 "migration_phases", "admin_requests", "audit_log", "users", "schema_version"):
        assert name in cols
    assert store.schema_version == CURRENT_VERSION
    assert sqlite3.connect(db_path).execute("SELECT version FROM schema_version").fetchone() == (CURRENT_VERSION,)


def test_sqlite_uses_wal(store: Store, db_path: Path) -> None:
    store.create_job("j", "pp1tp1dp1", 1, 1)
    assert sqlite3.connect(db_path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_upgrade_from_v1_keeps_data_and_matches_fresh_schema(tmp_path: Path) -> None:
    old = tmp_path / "v1.db"
    create_v1(create_engine(f"sqlite:///{old}"))
    con = sqlite3.connect(old)
    con.execute("INSERT INTO jobs (name, state, layout, gpus_per_node, max_devices, created_at, updated_at)"
                " VALUES ('legacy', 'running', 'pp2tp1dp1', 2, 2, '2024-01-01 00:00:00', '2024-01-01 00:00:00')")
    con.commit()
    con.close()
    assert "sla_tier" not in _columns(old)["jobs"]

    store = _upgraded(old, 1)
    job = store.find_job("legacy")
    assert job is not None and job.sla_tier == "standard" and job.layout == "pp2tp1dp1"
    rid = store.add_request(job.id, "suspend", {}, "ops")  # v2 table works
    assert store.get_request(rid) is not None
    _same_columns_as_fresh(store, old, tmp_path)
    Store(f"sqlite:///{old}").close()  # opening again is a no-op


def test_newer_schema_is_refused(db_path: Path) -> None:
    Store(f"sqlite:///{db_path}").close()
    con = sqlite3.connect(db_path)
    con.execute("UPDATE schema_version SET version = 999")
    con.commit()
    con.close()
    with pytest.raises(DatabaseError, match="newer"):
        Store(f"sqlite:///{db_path}")


def test_foreign_database_is_refused(db_path: Path) -> None:
    con = sqlite3.connect(db_path)
    con.execute("CREATE TABLE something (x int)")
    con.commit()
    con.close()
    with pytest.raises(DatabaseError, match="not an elastic database"):
        Store(f"sqlite:///{db_path}")


@pytest.mark.parametrize("url, match", [
    ("nosuchdialect://x/y", "unknown database kind"),
    ("sqlite:////nonexistent-dir/sub/x.db", "does not exist"),
    ("postgresql+nosuchdriver://u:secret@h/db", "unknown database kind"),
    ("://nothing", "cannot parse"),
    ("mysql+pymysql://u:secret@h/db", "driver module 'pymysql' is not installed"),
])
def test_bad_urls_give_clear_errors(url: str, match: str) -> None:
    with pytest.raises(DatabaseError, match=match) as err:
        Store(url)
    assert "secret" not in str(err.value)


def test_create_false_never_creates_a_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    with pytest.raises(DatabaseError, match="no database at"):
        Store(f"sqlite:///{missing}", create=False)
    assert not missing.exists()


def test_garbage_file_is_refused(db_path: Path) -> None:
    db_path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(DatabaseError, match="cannot"):
        Store(f"sqlite:///{db_path}")


def test_bare_path_and_memory_urls(tmp_path: Path) -> None:
    Store(str(tmp_path / "plain.db")).close()
    assert (tmp_path / "plain.db").exists()
    mem = Store("sqlite://")
    assert mem.create_job("m", "pp1tp1dp1", 1, 1) == 1
    assert mem.get_job(1) is not None


def test_upgrade_from_v2_adds_checkpoint_and_lost_step_columns(tmp_path: Path) -> None:
    from db.schema import MIGRATIONS, _stamp

    old = tmp_path / "v2.db"
    engine = create_engine(f"sqlite:///{old}")
    create_v1(engine)
    with engine.begin() as conn:
        MIGRATIONS[0](conn)
        _stamp(conn, 2)
    engine.dispose()
    con = sqlite3.connect(old)
    con.execute("INSERT INTO jobs (name, state, layout, gpus_per_node, max_devices, created_at, updated_at)"
                " VALUES ('j2', 'running', 'pp2tp1dp1', 1, 2, '2024-01-01 00:00:00', '2024-01-01 00:00:00')")
    con.commit()
    con.close()
    assert "checkpoint_path" not in _columns(old)["jobs"] and "steps_lost" not in _columns(old)["migrations"]

    store = _upgraded(old, 2)
    job = store.find_job("j2")
    assert job.checkpoint_path is None and job.checkpoint_step is None
    store.set_checkpoint(job.id, "/ck/step-6", 6, state="suspended")
    job = store.find_job("j2")
    assert (job.state, job.checkpoint_path, job.checkpoint_step) == ("suspended", "/ck/step-6", 6)
    mid = store.start_migration(job.id, "pp2tp1dp1", "pp1tp1dp1", "failure", {}, {})
    store.finish_migration(mid, "succeeded", None, None, None, {}, error="restored from checkpoint at step 6: "
                           "2 steps lost", at_step=6, steps_lost=2)
    m = store.get_migration(mid)
    assert (m.at_step, m.steps_lost) == (6, 2)
    _same_columns_as_fresh(store, old, tmp_path)


def _database_at(tmp_path: Path, version: int) -> Path:
    """A database file at an older schema version (v1 upgraded step by step), no rows."""
    from db.schema import MIGRATIONS, _stamp

    old = tmp_path / f"v{version}.db"
    engine = create_engine(f"sqlite:///{old}")
    create_v1(engine)
    with engine.begin() as conn:
        for step in MIGRATIONS[:version - 1]:
            step(conn)
        _stamp(conn, version)
    engine.dispose()
    return old


def test_upgrade_from_v3_adds_a_nullable_pause(tmp_path: Path) -> None:
    old = _database_at(tmp_path, 3)
    assert "pause_s" not in _columns(old)["migrations"]
    store = _upgraded(old, 3)
    job = store.create_job("j", "pp2tp1dp1", 1, 2)
    mid = store.start_migration(job, "pp2tp1dp1", "pp1tp1dp1", "resize", {}, {})
    assert store.get_migration(mid).pause_s is None
    store.set_pause(mid, 0.75)
    assert store.get_migration(mid).pause_s == 0.75
    with pytest.raises(ValueError, match="non-negative"):
        store.set_pause(mid, -1.0)
    _same_columns_as_fresh(store, old, tmp_path)


def test_upgrade_from_v4_adds_session_version_audit_address_and_min_nodes(tmp_path: Path) -> None:
    old = _database_at(tmp_path, 4)
    con = sqlite3.connect(old)
    con.execute("INSERT INTO users (name, password_hash, role, created_at) VALUES ('u', 'x', 'admin', '2024-01-01')")
    con.commit()
    con.close()
    assert "session_version" not in _columns(old)["users"] and "address" not in _columns(old)["audit_log"]

    store = _upgraded(old, 4)
    user = store.get_user("u")
    assert user is not None and user.session_version == 0
    jid = store.create_job("j", "pp1tp1dp2", 1, 2, min_nodes=2)
    assert store.get_job(jid).min_nodes == 2
    _same_columns_as_fresh(store, old, tmp_path)
    indexes = {i["name"] for i in inspect(create_engine(f"sqlite:///{old}")).get_indexes("jobs")}
    assert "ix_jobs_state" in indexes


def test_upgrade_from_v6_adds_launch_spec_steps_and_cluster_samples(tmp_path: Path) -> None:
    old = _database_at(tmp_path, 6)
    assert "launch_spec" not in _columns(old)["jobs"] and "job_steps" not in _columns(old)
    store = _upgraded(old, 6)
    job = store.create_job("j", "pp2tp1dp1", 1, 2)
    assert store.launch_spec(job) is None
    store.record_step(job, 1, 2.5, "pp2tp1dp1")
    assert [(s.step, s.loss) for s in store.steps(job)] == [(1, 2.5)]
    _same_columns_as_fresh(store, old, tmp_path)


def _with_legacy_job(path: Path, gpus_per_node: int, max_devices: int) -> sqlite3.Connection:
    """Job 1 ('legacy', pp1tp1dp2) written as an older release did; returns the connection, committed."""
    con = sqlite3.connect(path)
    con.execute("INSERT INTO jobs (id, name, state, layout, gpus_per_node, max_devices, created_at, updated_at)"
                " VALUES (1, 'legacy', 'running', 'pp1tp1dp2', ?, ?, '2024-01-01', '2024-01-01')",
                (gpus_per_node, max_devices))
    con.commit()
    return con


def test_upgrade_from_v7_adds_components_and_node_sizes(tmp_path: Path) -> None:
    """Rows written before v8 read as component 0, and a node's size as the devices it was given."""
    old = _database_at(tmp_path, 7)
    assert "component" not in _columns(old)["rank_map_entries"] and "gpus" not in _columns(old)["nodes"]
    con = _with_legacy_job(old, gpus_per_node=2, max_devices=2)
    con.execute("INSERT INTO nodes (id, job_id, name, state, pinned) VALUES (1, 1, 'n1', 'active', 1)")
    con.executemany("INSERT INTO devices (node_id, gpu, state) VALUES (1, ?, 'used')", [(0,), (1,)])
    con.execute("INSERT INTO rank_maps (id, job_id, epoch, layout, started_at) VALUES (1, 1, 0, 'pp1tp1dp2', '2024-01-01')")
    con.executemany("INSERT INTO rank_map_entries (rank_map_id, virtual_rank, node, gpu, pp, dp, tp)"
                    " VALUES (1, ?, 'n1', ?, 0, ?, 0)", [(0, 0, 0), (1, 1, 1)])
    con.commit()
    con.close()
    store = _upgraded(old, 7)
    assert [e.component for e in store.current_rank_map(1).entries] == [0, 0]  # type: ignore[union-attr]
    assert [(n.gpus, n.component) for n in store.list_nodes(1)] == [(2, 0)]
    store.set_node_state(1, "b1", "idle", gpus=4, component=1)
    assert [(n.name, n.gpus, n.component) for n in store.list_nodes(1)] == [("n1", 2, 0), ("b1", 4, 1)]
    _same_columns_as_fresh(store, old, tmp_path)


def test_upgrade_from_v8_adds_a_jobs_max_nodes(tmp_path: Path) -> None:
    old = _database_at(tmp_path, 8)
    assert "max_nodes" not in _columns(old)["jobs"]
    _with_legacy_job(old, gpus_per_node=4, max_devices=12).close()
    store = _upgraded(old, 8)
    from db.requests import most_nodes

    assert store.get_job(1).max_nodes is None and most_nodes(store.get_job(1)) == 3  # the old derivation
    store.update_job(1, max_nodes=4)
    assert most_nodes(store.get_job(1)) == 4
    with pytest.raises(ValueError, match="must be positive"):
        store.update_job(1, max_nodes=0)
    _same_columns_as_fresh(store, old, tmp_path)


# ------------------------------------------------- the same upgrade path on SQLite and PostgreSQL
def _typed_columns(url: str) -> dict[str, dict[str, str]]:
    """table -> column -> its type as the server reports it (VARCHAR(200), TIMESTAMP, JSON ...)."""
    engine = create_engine(url)
    insp = inspect(engine)
    out = {t: {c["name"]: str(c["type"]) for c in insp.get_columns(t)} for t in insp.get_table_names()}
    engine.dispose()
    return out


def _indexes(url: str) -> dict[str, set[tuple[str, tuple[str, ...]]]]:
    """table -> its indexes as (name, columns)."""
    engine = create_engine(url)
    insp = inspect(engine)
    out = {t: {(i["name"], tuple(i["column_names"])) for i in insp.get_indexes(t)} for t in insp.get_table_names()}
    engine.dispose()
    return out


def _another_fresh_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'other-fresh.db'}"
    return request.getfixturevalue("pg_server").create_database()


@both_backends
@pytest.mark.parametrize("version", range(1, CURRENT_VERSION))
def test_upgrade_from_every_version_keeps_rows_and_matches_a_fresh_schema(
        backend: str, fresh_url: str, version: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A database left at `version` (v1 plus the steps up to it, as the releases of the time wrote it),
    with a job and a request in it, upgrades in place: rows kept, the columns (and on PostgreSQL their
    types) and the indexes those of a database created fresh on the same server, and the v10 request
    columns usable."""
    from sqlalchemy import text

    from db.schema import MIGRATIONS, _stamp

    engine = create_engine(fresh_url)
    create_v1(engine)
    with engine.begin() as conn:
        for step in MIGRATIONS[:version - 1]:
            step(conn)
        _stamp(conn, version)
        conn.execute(text("INSERT INTO jobs (name, state, layout, gpus_per_node, max_devices, created_at, updated_at)"
                          " VALUES ('legacy', 'running', 'pp1tp1dp2', 2, 2, :t, :t)"), {"t": datetime(2024, 1, 1)})
        if version >= 2:
            conn.execute(text("INSERT INTO admin_requests (job_id, action, params, requested_by, status, created_at)"
                              " VALUES (1, 'suspend', '{}', 'ops', 'pending', :t)"), {"t": datetime(2024, 1, 1)})
    engine.dispose()

    store = Store(fresh_url)
    assert (store.schema_found, store.schema_version) == (version, CURRENT_VERSION)
    job = store.find_job("legacy")
    assert job is not None and (job.id, job.sla_tier, job.min_nodes, job.mode) == (1, "standard", 1, "live")
    if version < 2:
        store.add_request(job.id, "suspend", {}, "ops")
    taken = store.take_request(job.id, "host:1")
    assert taken is not None and taken.taken_by == "host:1" and store.complete_request(taken.id, "done", "ok")
    store.close()
    Store(fresh_url).close()  # opening again changes nothing

    fresh = _another_fresh_url(backend, tmp_path, request)
    Store(fresh).close()
    upgraded, created = _typed_columns(fresh_url), _typed_columns(fresh)
    if backend == "sqlite":  # declared types are only hints to SQLite (TIMESTAMP, DATETIME: the same)
        upgraded, created = ({t: set(c) for t, c in cols.items()} for cols in (upgraded, created))
    assert upgraded == created
    assert ("ix_migrations_started_at", ("started_at", "id")) in _indexes(fresh_url)["migrations"]
    assert _indexes(fresh_url) == _indexes(fresh)


def _lost_race(msg: str, name: str) -> OperationalError:
    orig = sqlite3.OperationalError(msg)
    orig.sqlite_errorname = name  # what sqlite3 sets on the error it raises
    return OperationalError("BEGIN IMMEDIATE", {}, orig)


@pytest.mark.parametrize("name, opens", [("SQLITE_PROTOCOL", True), ("SQLITE_ERROR", False)])
def test_a_lost_wal_index_race_at_open_is_retried_and_any_other_error_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, opens: bool) -> None:
    import db.base
    real, calls = db.base.upgrade, []

    def loses_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise _lost_race("locking protocol", name)
        return real(*args, **kwargs)

    monkeypatch.setattr(db.base, "upgrade", loses_once)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    if opens:
        assert Store(url).schema_version == CURRENT_VERSION and len(calls) == 2
    else:
        with pytest.raises(DatabaseError, match="locking protocol"):
            Store(url)
        assert len(calls) == 1
