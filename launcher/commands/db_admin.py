"""`elastic db upgrade|version`: the one explicit way to bring a database to this release's schema.

Every other command refuses an older schema with a message naming this command, so an upgrade
never happens behind an operator's back (e.g. when a read-only `elastic history` looks at a backup).
"""
from __future__ import annotations

import argparse
import sys

from launcher.commands.history import add_db_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("upgrade", "version"),
                        help="upgrade: apply the pending schema steps; version: print found and current versions")
    add_db_argument(parser)


def run(args: argparse.Namespace) -> int:
    from db import DatabaseError, Store
    from db.schema import CURRENT_VERSION
    from db.urls import default_url, normalize_url
    from launcher.errors import UsageError

    url = args.db or default_url()
    try:
        if args.action == "version":
            from db.engine import open_engine
            from db.schema import read_version

            engine, shown = open_engine(normalize_url(url), create=False, readonly=True)
            try:
                with engine.connect() as conn:
                    found = read_version(conn)
            finally:
                engine.dispose()
            print(f"{shown}: schema version {found if found is not None else 'none (not an elastic database)'}; "
                  f"this release: {CURRENT_VERSION}")
            return 0
        store = Store(url, create=False, upgrade_schema=True)
    except DatabaseError as exc:
        raise UsageError(str(exc)) from None
    try:
        found, now = store.schema_found, store.schema_version
        print(f"{store.display_url}: schema version {found} -> {now}" if found != now
              else f"{store.display_url}: already at schema version {now}", file=sys.stderr)
        return 0
    finally:
        store.close()
