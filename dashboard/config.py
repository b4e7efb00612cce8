"""Dashboard configuration: where the secret key and DB URL come from (never the code)."""
from __future__ import annotations

import os
import tomllib
from typing import Any

MIN_SECRET_LEN = 16
#: TOML key -> create_app config key
FILE_KEYS = {"secret_key": "SECRET_KEY", "db": "DB_URL", "host": "HOST", "port": "PORT", "threads": "THREADS",
             "secure_cookies": "SECURE_COOKIES", "session_lifetime": "SESSION_LIFETIME_S",
             "operators_group": "OPERATORS_GROUP", "private_jobs": "PRIVATE_JOBS", "munge_socket": "MUNGE_SOCKET",
             "login": "LOGIN", "pam_service": "PAM_SERVICE", "proxy_addresses": "PROXY_ADDRESSES",
             "proxy_user_header": "PROXY_USER_HEADER"}
#: integer keys and their allowed ranges
INT_RANGES = {"port": (1, 65535), "threads": (1, 256), "session_lifetime": (60, 90 * 86400)}


class ConfigError(Exception):
    """The dashboard cannot start with this configuration; the message says how to fix it."""


def load_config(path: str | None = None, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Build the create_app config from an optional TOML file and the environment.

    File keys: secret_key, db, host, port, threads, secure_cookies, session_lifetime (seconds); each is
    type- and range-checked here, so a bad file is a one-line ConfigError. $ELASTIC_SECRET_KEY and $ELASTIC_DB_URL win over
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
        unknown = set(data) - set(FILE_KEYS)
        if unknown:
            raise ConfigError(f"config file {path}: unknown keys {', '.join(sorted(unknown))} "
                              f"(allowed: {', '.join(FILE_KEYS)})")
        for key, value in data.items():
            config[FILE_KEYS[key]] = _checked(path, key, value)
    if env.get("ELASTIC_SECRET_KEY"):
        config["SECRET_KEY"] = env["ELASTIC_SECRET_KEY"]
    if env.get("ELASTIC_DB_URL"):
        config.setdefault("DB_URL", env["ELASTIC_DB_URL"])
    return config


def _checked(path: str, key: str, value: Any) -> Any:
    """The value if it has the right type and range for `key`, else ConfigError naming both."""
    if key in INT_RANGES:
        lo, hi = INT_RANGES[key]
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"config file {path}: {key} must be a whole number in {lo}..{hi}, not {value!r}")
    elif key in ("secure_cookies", "private_jobs"):
        if not isinstance(value, bool):
            raise ConfigError(f"config file {path}: {key} must be true or false, not {value!r}")
    elif key == "proxy_addresses":
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise ConfigError(f"config file {path}: proxy_addresses must be a list of addresses, not {value!r}")
    elif not isinstance(value, str):
        raise ConfigError(f"config file {path}: {key} must be a string, not {value!r}")
    return value


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
