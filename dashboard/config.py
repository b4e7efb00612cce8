"""Dashboard configuration: where the secret key and DB URL come from (never the code)."""
from __future__ import annotations

import os
import tomllib
from typing import Any

MIN_SECRET_LEN = 16


class ConfigError(Exception):
    """The dashboard cannot start with this configuration; the message says how to fix it."""


def load_config(path: str | None = None, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Build the create_app config from an optional TOML file and the environment.

    File keys: secret_key, db, host, port. $ELASTIC_SECRET_KEY and $ELASTIC_DB_URL win over
    the file, so a deployment can keep the key out of files altogether.
    """
    env = os.environ if environ is None else environ
    config: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        unknown = set(data) - {"secret_key", "db", "host", "port"}
        if unknown:
            raise ConfigError(f"config file {path}: unknown keys {', '.join(sorted(unknown))} "
                              "(allowed: secret_key, db, host, port)")
        mapping = {"secret_key": "SECRET_KEY", "db": "DB_URL", "host": "HOST", "port": "PORT"}
        config.update({mapping[k]: v for k, v in data.items()})
    if env.get("ELASTIC_SECRET_KEY"):
        config["SECRET_KEY"] = env["ELASTIC_SECRET_KEY"]
    if env.get("ELASTIC_DB_URL"):
        config.setdefault("DB_URL", env["ELASTIC_DB_URL"])
    return config


def check_secret(config: dict[str, Any]) -> str:
    """The secret key, or ConfigError: sessions, logins and CSRF tokens all depend on it."""
    key = config.get("SECRET_KEY")
    if not key:
        raise ConfigError(
            "no secret key configured: admin actions, logins and CSRF tokens need one; set "
            "ELASTIC_SECRET_KEY or secret_key in the --config FILE (e.g. from "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    if not isinstance(key, str) or len(key) < MIN_SECRET_LEN:
        raise ConfigError(f"secret key too short: use at least {MIN_SECRET_LEN} random characters")
    return key
