"""Database URL conventions, kept free of SQLAlchemy so the CLI can import them cheaply."""
from __future__ import annotations

import os

#: Used when neither --db nor ELASTIC_DB_URL is given; /var/ is git-ignored.
DEFAULT_URL = "sqlite:///var/elastic.db"


def default_url() -> str:
    """The URL to use when the user gave none: $ELASTIC_DB_URL, else DEFAULT_URL."""
    return os.environ.get("ELASTIC_DB_URL") or DEFAULT_URL


#: PostgreSQL URLs without a driver (as psql and most tools write them) use psycopg 3, the driver of
#: the `postgres` extra; SQLAlchemy's own default would be psycopg2, which is not installed.
PG_SCHEMES = ("postgresql://", "postgres://")
PG_DRIVER = "postgresql+psycopg://"


def normalize_url(url: str) -> str:
    """Accept a bare file path as shorthand for a SQLite URL (operators type paths), and
    postgresql:// (or postgres://) as postgresql+psycopg://."""
    url = url.strip()
    if "://" not in url:
        return "sqlite:///" + url
    for scheme in PG_SCHEMES:
        if url.startswith(scheme):
            return PG_DRIVER + url[len(scheme):]
    return url
