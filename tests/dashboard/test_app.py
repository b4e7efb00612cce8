"""App factory configuration checks."""
from __future__ import annotations

import pytest

from dashboard import ConfigError, create_app, load_config
from db import DatabaseError
from tests.db.backends import both_backends


@both_backends
def test_refuses_to_start_without_secret_key(db_url: str) -> None:
    with pytest.raises(ConfigError, match="ELASTIC_SECRET_KEY"):
        create_app({"DB_URL": db_url})
    with pytest.raises(ConfigError, match="too short"):
        create_app({"DB_URL": db_url, "SECRET_KEY": "short"})


def test_refuses_bad_database() -> None:
    with pytest.raises(ConfigError, match="no database"):
        create_app({"SECRET_KEY": "k" * 32})
    with pytest.raises(DatabaseError, match="unknown database kind"):
        create_app({"DB_URL": "nosuch://x", "SECRET_KEY": "k" * 32})


def test_config_file_and_env(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "dash.toml"
    cfg.write_text('secret_key = "from-file-0123456789"\nport = 9000\n')
    assert load_config(str(cfg), {}) == {"SECRET_KEY": "from-file-0123456789", "PORT": 9000}
    assert load_config(str(cfg), {"ELASTIC_SECRET_KEY": "from-env-0123456789"})["SECRET_KEY"] == "from-env-0123456789"
    cfg.write_text('secret = "typo"\n')
    with pytest.raises(ConfigError, match="unknown keys"):
        load_config(str(cfg), {})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.toml"), {})
