"""The database backends tests run on: `both_backends` (SQLite and PostgreSQL) and a throwaway
PostgreSQL server for them: Debian's binaries, initdb into a temp dir, listening
on 127.0.0.1 only (a free port) and a unix socket in that dir, stopped and deleted at the end.

Why a real server: what this project relies on PostgreSQL for (row locks, SKIP LOCKED, advisory
locks, transactional DDL, strict VARCHAR lengths) is exactly what SQLite does not have, so only a
real server can show it works. initdb refuses to run as root: as root the server runs as the
`postgres` OS user (runuser) in a dir it owns. scripts/install-postgres.sh installs the packages.
"""
from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

BACKENDS = ["sqlite", "postgresql"]

#: a test (or `pytestmark`) decorated with this runs once on SQLite and once on the real server;
#: it must use the `backend` fixture, directly or through store/db_url/fresh_url (tests/conftest.py)
both_backends = pytest.mark.parametrize("backend", BACKENDS, indirect=True)

INSTALL_HINT = "run scripts/install-postgres.sh (apt-get install postgresql)"


def find_bindir() -> Path | None:
    """The newest /usr/lib/postgresql/<version>/bin with initdb and pg_ctl ($ELASTIC_PG_BINDIR wins)."""
    wanted = os.environ.get("ELASTIC_PG_BINDIR")
    candidates = [wanted] if wanted else sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                                                key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0)
    for c in reversed(candidates):
        if c and (Path(c) / "initdb").exists() and (Path(c) / "pg_ctl").exists():
            return Path(c)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """One server; `create_database` hands out fresh databases (optionally copies of a template)."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="elastic-pg-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.port = _free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
        self._names = itertools.count()
        self.started = False

    def _run(self, *argv: str) -> None:
        out = subprocess.run([*self._as, *argv], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({out.returncode}): {out.stderr.strip()} {log[-2000:]}")

    def start(self) -> "PgServer":
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                  "-E", "UTF8", "--no-sync", "--locale=C")
        # fsync off: a test server's data is thrown away; max_connections: concurrent writer tests
        opts = (f"-p {self.port} -h 127.0.0.1 -k {self.root} -F -c synchronous_commit=off "
                "-c full_page_writes=off -c max_connections=200 -c shared_buffers=32MB")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts,
                  "-w", "-t", "60", "start")
        self.started = True
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(sql)

    def create_database(self, template: str | None = None, name: str | None = None) -> str:
        """A new empty database (or a copy of `template`, which nobody may be connected to); its URL."""
        name = name or f"t{os.getpid()}_{next(self._names)}"
        self._admin(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        if self.started:
            subprocess.run([*self._as, str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                            "-w", "stop"], capture_output=True, timeout=60)
            self.started = False
        shutil.rmtree(self.root, ignore_errors=True)
