"""Schema versioning: a `schema_version` table and an ordered list of upgrade steps.

A fresh database is created from the current models and stamped with CURRENT_VERSION.
An existing one is brought forward by running MIGRATIONS[v-1:] (step i upgrades from
version i+1 to i+2), each step plus its version bump in one transaction. Steps use frozen
Core definitions or plain DDL, never the current models, so old steps keep meaning
the same thing when the models change later.
"""
from __future__ import annotations

from typing import Callable

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    inspect,
    text,
)
from sqlalchemy.engine import Connection, Engine

from db.engine import sqlite_write_lock
from db.errors import DatabaseError
from db.models import Base

Step = Callable[[Connection], None]


def v1_metadata() -> MetaData:
    """The launcher-only schema as first shipped (v1): no SLA tier, no dashboard tables."""
    md = MetaData()
    Table("schema_version", md, Column("id", Integer, primary_key=True), Column("version", Integer, nullable=False))
    Table(
        "jobs", md,
        Column("id", Integer, primary_key=True),
        Column("name", String(200), nullable=False, index=True),
        Column("slurm_job_id", String(64)),
        Column("state", String(16), nullable=False),
        Column("layout", String(64), nullable=False),
        Column("gpus_per_node", Integer, nullable=False),
        Column("pinned_node", String(200)),
        Column("max_devices", Integer, nullable=False),
        Column("created_at", DateTime, nullable=False),
        Column("updated_at", DateTime, nullable=False),
    )
    Table(
        "nodes", md,
        Column("id", Integer, primary_key=True),
        Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
        Column("name", String(200), nullable=False),
        Column("state", String(16), nullable=False),
        Column("pinned", Boolean, nullable=False),
        UniqueConstraint("job_id", "name"),
    )
    Table(
        "devices", md,
        Column("id", Integer, primary_key=True),
        Column("node_id", Integer, ForeignKey("nodes.id", ondelete="CASCADE"), nullable=False, index=True),
        Column("gpu", Integer, nullable=False),
        Column("state", String(16), nullable=False),
        UniqueConstraint("node_id", "gpu"),
    )
    Table(
        "rank_maps", md,
        Column("id", Integer, primary_key=True),
        Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
        Column("epoch", Integer, nullable=False),
        Column("layout", String(64), nullable=False),
        Column("started_at", DateTime, nullable=False),
        Column("ended_at", DateTime),
        UniqueConstraint("job_id", "epoch"),
    )
    Table(
        "rank_map_entries", md,
        Column("id", Integer, primary_key=True),
        Column("rank_map_id", Integer, ForeignKey("rank_maps.id", ondelete="CASCADE"), nullable=False, index=True),
        Column("virtual_rank", Integer, nullable=False),
        Column("node", String(200), nullable=False),
        Column("gpu", Integer, nullable=False),
        Column("pp", Integer, nullable=False),
        Column("dp", Integer, nullable=False),
        Column("tp", Integer, nullable=False),
    )
    Table(
        "migrations", md,
        Column("id", Integer, primary_key=True),
        Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
        Column("from_layout", String(64), nullable=False),
        Column("to_layout", String(64), nullable=False),
        Column("trigger", String(16), nullable=False),
        Column("status", String(16), nullable=False),
        Column("started_at", DateTime, nullable=False),
        Column("finished_at", DateTime),
        Column("bytes_moved", BigInteger),
        Column("bytes_checkpoint", BigInteger),
        Column("bit_exact", Boolean),
        Column("error", Text),
        Column("plan_summary", JSON, nullable=False),
        Column("fragmentation_before", JSON, nullable=False),
        Column("fragmentation_after", JSON),
        Index("ix_migrations_started_at", "started_at"),
    )
    Table(
        "migration_phases", md,
        Column("id", Integer, primary_key=True),
        Column("migration_id", Integer, ForeignKey("migrations.id", ondelete="CASCADE"), nullable=False, index=True),
        Column("phase", String(16), nullable=False),
        Column("seconds", Float, nullable=False),
    )
    return md


def _v1_to_v2(conn: Connection) -> None:
    """v2: SLA tiers on jobs, and the dashboard's tables (admin requests, audit, users)."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN sla_tier VARCHAR(16) NOT NULL DEFAULT 'standard'"))
    md = MetaData()
    Table("jobs", md, Column("id", Integer, primary_key=True))
    Table(
        "admin_requests", md,
        Column("id", Integer, primary_key=True),
        Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
        Column("action", String(16), nullable=False),
        Column("params", JSON, nullable=False),
        Column("requested_by", String(200), nullable=False),
        Column("status", String(16), nullable=False),
        Column("message", Text),
        Column("created_at", DateTime, nullable=False),
        Column("completed_at", DateTime),
    )
    Table(
        "audit_log", md,
        Column("id", Integer, primary_key=True),
        Column("who", String(200), nullable=False),
        Column("action", String(64), nullable=False),
        Column("target", String(200), nullable=False),
        Column("result", Text, nullable=False),
        Column("at", DateTime, nullable=False, index=True),
    )
    Table(
        "users", md,
        Column("id", Integer, primary_key=True),
        Column("name", String(200), nullable=False, unique=True),
        Column("password_hash", String(512), nullable=False),
        Column("role", String(16), nullable=False),
        Column("created_at", DateTime, nullable=False),
    )
    md.create_all(conn, tables=[md.tables["admin_requests"], md.tables["audit_log"], md.tables["users"]])


def _v2_to_v3(conn: Connection) -> None:
    """v3: the checkpoint a suspended job resumes from (jobs), and where a migration cut in and how many
    committed steps it lost (migrations: a failure restored from a safety checkpoint loses some)."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN checkpoint_path TEXT"))
    conn.execute(text("ALTER TABLE jobs ADD COLUMN checkpoint_step INTEGER"))
    conn.execute(text("ALTER TABLE migrations ADD COLUMN at_step INTEGER"))
    conn.execute(text("ALTER TABLE migrations ADD COLUMN steps_lost INTEGER"))


def _v3_to_v4(conn: Connection) -> None:
    """v4: the pause a migration caused (seconds from the last committed step on the old layout to
    the first committed step on the new one; NULL when unknown)."""
    conn.execute(text("ALTER TABLE migrations ADD COLUMN pause_s FLOAT"))


def _v4_to_v5(conn: Connection) -> None:
    """v5: a per-user session version (logout and password changes revoke saved cookies), the
    client address on audit rows, a job's MIN node count (requests never go below it), and an index
    on job state (the jobs page lists running jobs first, one page at a time)."""
    conn.execute(text("ALTER TABLE users ADD COLUMN session_version INTEGER NOT NULL DEFAULT 0"))
    conn.execute(text("ALTER TABLE audit_log ADD COLUMN address VARCHAR(64)"))
    conn.execute(text("ALTER TABLE jobs ADD COLUMN min_nodes INTEGER NOT NULL DEFAULT 1"))
    conn.execute(text("CREATE INDEX ix_jobs_state ON jobs (state)"))


def _v5_to_v6(conn: Connection) -> None:
    """v6: a job's mode (live through the runtime API, or restart: torchrun's contract) and the last step
    the launcher saw; a migration's kind (live, or restart: every worker stopped and a new world started)."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN mode VARCHAR(16) NOT NULL DEFAULT 'live'"))
    conn.execute(text("ALTER TABLE jobs ADD COLUMN last_step INTEGER"))
    conn.execute(text("ALTER TABLE migrations ADD COLUMN kind VARCHAR(16) NOT NULL DEFAULT 'live'"))


def _v6_to_v7(conn: Connection) -> None:
    """v7: what the cluster view needs: each job's launch spec (model, node range, layout per size:
    enough for a dashboard dry run of the planner), the steps workers commit (loss curve, step rate),
    and samples of cluster-wide fragmentation over time."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN launch_spec JSON"))
    md = MetaData()
    Table("jobs", md, Column("id", Integer, primary_key=True))
    Table(
        "job_steps", md,
        Column("id", Integer, primary_key=True),
        Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        Column("step", Integer, nullable=False),
        Column("loss", Float),
        Column("layout", String(64), nullable=False),
        Column("at", DateTime, nullable=False),
        Index("ix_job_steps_job_step", "job_id", "step"),
    )
    Table(
        "cluster_samples", md,
        Column("id", Integer, primary_key=True),
        Column("at", DateTime, nullable=False, index=True),
        Column("source", String(16), nullable=False),
        Column("gpus_total", Integer, nullable=False),
        Column("gpus_free", Integer, nullable=False),
        Column("stranded", Integer, nullable=False),
        Column("free_nodes", Integer, nullable=False),
        Column("largest_free_block", Integer, nullable=False),
        Column("frag_index", Float, nullable=False),
    )
    md.create_all(conn, tables=[md.tables["job_steps"], md.tables["cluster_samples"]])


def _v7_to_v8(conn: Connection) -> None:
    """v8: heterogeneous jobs and uneven nodes: the het-job component of every rank (rank_map_entries)
    and of every node, and each node's GPU count (NULL on older rows: the job's gpus_per_node)."""
    conn.execute(text("ALTER TABLE rank_map_entries ADD COLUMN component INTEGER NOT NULL DEFAULT 0"))
    conn.execute(text("ALTER TABLE nodes ADD COLUMN gpus INTEGER"))
    conn.execute(text("ALTER TABLE nodes ADD COLUMN component INTEGER NOT NULL DEFAULT 0"))


def _v8_to_v9(conn: Connection) -> None:
    """v9: a job's MAX node count (--nnodes MAX). Requests used to derive it from max_devices over
    gpus_per_node, which on uneven nodes (4,4,2,2: 12 devices, 4 per node) undercounts; NULL on older
    rows keeps that derivation."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN max_nodes INTEGER"))


def _v9_to_v10(conn: Connection) -> None:
    """v10: which launcher took an admin request, and when. Several launchers (and the dashboard) share
    one PostgreSQL database; a launcher claims each pending request with SELECT ... FOR UPDATE SKIP
    LOCKED and marks it taken, so no request is carried out twice. It stays `pending` until answered.
    And the history's order (started_at, then id) is one index: with started_at alone PostgreSQL sorted
    every migration for each page (10,000 migrations: 78 ms a page, 0.2 ms with this index).
    And the launcher's heartbeat on its job: a job whose launcher died stays `running` in the table, and
    only the heartbeat's age tells that nobody drives it any more (db.liveness)."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN heartbeat_at TIMESTAMP"))
    conn.execute(text("ALTER TABLE admin_requests ADD COLUMN taken_at TIMESTAMP"))
    conn.execute(text("ALTER TABLE admin_requests ADD COLUMN taken_by VARCHAR(200)"))
    conn.execute(text("DROP INDEX ix_migrations_started_at"))
    conn.execute(text("CREATE INDEX ix_migrations_started_at ON migrations (started_at, id)"))


def _v10_to_v11(conn: Connection) -> None:
    """v11: a job's resize policy (manual: people and signals only; opportunistic: the launcher grows into
    idle nodes and yields to pending jobs by itself), which an admin can switch from the dashboard, and the
    policy's last look at the cluster (idle nodes, the pending jobs it watches, its decision) for /cluster."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN policy VARCHAR(16) NOT NULL DEFAULT 'manual'"))
    conn.execute(text("ALTER TABLE jobs ADD COLUMN policy_watch JSON"))


def _v11_to_v12(conn: Connection) -> None:
    """v12: who owns a job (the Unix user whose launcher created it, proven by munge when the launcher writes
    through `elastic serve`), so that a user may act on their own jobs only and operators on all. Jobs recorded
    before have no owner: only operators may act on them."""
    conn.execute(text("ALTER TABLE jobs ADD COLUMN owner VARCHAR(64)"))
    conn.execute(text("ALTER TABLE jobs ADD COLUMN owner_uid INTEGER"))


#: MIGRATIONS[i] upgrades a database from version i+1 to version i+2.
MIGRATIONS: list[Step] = [_v1_to_v2, _v2_to_v3, _v3_to_v4, _v4_to_v5, _v5_to_v6, _v6_to_v7, _v7_to_v8, _v8_to_v9,
                         _v9_to_v10, _v10_to_v11, _v11_to_v12]
CURRENT_VERSION = len(MIGRATIONS) + 1


def read_version(conn: Connection) -> int | None:
    """The stored version, or None when the database has no elastic schema at all."""
    if not inspect(conn).has_table("schema_version"):
        return None
    row = conn.execute(text("SELECT version FROM schema_version ORDER BY id LIMIT 1")).first()
    return int(row[0]) if row else None


def _stamp(conn: Connection, version: int) -> None:
    updated = conn.execute(text("UPDATE schema_version SET version = :v"), {"v": version}).rowcount
    if not updated:
        conn.execute(text("INSERT INTO schema_version (id, version) VALUES (1, :v)"), {"v": version})


def create_v1(engine: Engine) -> None:
    """Create a v1 database (used by tests of the upgrade path, and kept as history)."""
    with engine.begin() as conn:
        v1_metadata().create_all(conn)
        _stamp(conn, 1)


def _lock_schema(conn: Connection) -> None:
    """Serialise schema changes between processes (several launchers starting at once on an empty
    database would otherwise all create the tables, and all but one fail): on PostgreSQL a
    transaction-scoped advisory lock, on SQLite the database's write lock (BEGIN IMMEDIATE)."""
    sqlite_write_lock(conn)
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})


#: the advisory lock key of schema changes (any constant; "elastic" in ASCII)
SCHEMA_LOCK_KEY = 0x656C6173746963


def _not_elastic(url_for_messages: str, has_tables: bool) -> DatabaseError:
    return DatabaseError(f"{url_for_messages} {'holds tables but ' if has_tables else 'has '}no schema_version: "
                         "it is not an elastic database; check --db")


def upgrade(engine: Engine, url_for_messages: str, *, create: bool = True,
            migrate: bool = True) -> tuple[int | None, int]:
    """Bring the schema to CURRENT_VERSION; return (version found, version now).

    Refuses databases written by a newer release rather than guessing at their shape.
    create=False: an empty database is refused instead of given the schema; migrate=False: an
    older schema is refused (with the command that upgrades it) instead of upgraded in place.
    With both False nothing is ever written: that is how read-only commands open a database.
    Each write transaction holds the schema lock and reads the version again under it, so
    concurrent openers create or upgrade once and the others see the result.
    """
    with engine.connect() as conn:
        found = read_version(conn)
        has_tables = bool(inspect(conn).get_table_names())
    if found is None:
        if not create:
            raise _not_elastic(url_for_messages, has_tables)
        with engine.begin() as conn:
            _lock_schema(conn)
            found = read_version(conn)  # another opener may have created it meanwhile
            if found is None:
                # tables without a version, seen under the lock: another opener's schema half-seen before
                # its commit is not this (the first look, outside the lock, can catch exactly that)
                if inspect(conn).get_table_names():
                    raise _not_elastic(url_for_messages, True)
                Base.metadata.create_all(conn)
                _stamp(conn, CURRENT_VERSION)
                return None, CURRENT_VERSION
    if found > CURRENT_VERSION:
        raise DatabaseError(
            f"{url_for_messages} has schema version {found}, newer than this release understands "
            f"({CURRENT_VERSION}); upgrade elastic-launch"
        )
    if found < CURRENT_VERSION and not migrate:
        raise DatabaseError(
            f"{url_for_messages} has schema version {found}, older than this release's {CURRENT_VERSION}; "
            f"back it up, then run `elastic db upgrade --db URL` (this command does not change it)"
        )
    while found < CURRENT_VERSION:  # nothing is written (not even a lock taken) to a current database
        with engine.begin() as conn:
            _lock_schema(conn)
            version = read_version(conn) or CURRENT_VERSION
            if version >= CURRENT_VERSION:
                return found, CURRENT_VERSION
            MIGRATIONS[version - 1](conn)
            _stamp(conn, version + 1)
    return found, CURRENT_VERSION
