"""`create_app(config)`: wires the Store, auth/CSRF, views and actions together."""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from flask import Flask

from dashboard import actions, audit, auth, cluster_views, events, security, throttle, views
from dashboard.config import ConfigError, check_secret
from service import api

# templates/ sits next to dashboard/ in a checkout; an installed wheel ships it as dashboard/templates
# (pyproject.toml, [tool.setuptools.package-dir])
_HERE = Path(__file__).resolve().parent
TEMPLATES = next((p for p in (_HERE / "templates", _HERE.parent / "templates") if p.is_dir()), _HERE / "templates")
DEFAULT_THREADS = 8
DEFAULT_SESSION_LIFETIME_S = 8 * 3600
MAX_REQUEST_BYTES = 64 * 1024  # forms are tiny; a 400 kB "user name" is refused with 413


def create_app(config: dict[str, Any]) -> Flask:
    """Build the dashboard app.

    config keys: DB_URL (required), SECRET_KEY (required: refuses to start without it,
    since admin actions and logins depend on signed sessions), POLL_SECONDS (default 2),
    THREADS (server threads; the connection pool is sized to match, default 8),
    SECURE_COOKIES (send the session cookie over HTTPS only), SESSION_LIFETIME_S (default 8 h),
    TESTING; the service's API (service.api): OPERATORS_GROUP (Unix group whose members act on every job),
    PRIVATE_JOBS (users see only their own jobs), MUNGE_SOCKET, SLURM_JOB_UID (Slurm job id -> its uid). Raises ConfigError or db.DatabaseError with a clear message.
    """
    from db import Store

    if not config.get("DB_URL"):
        raise ConfigError("no database configured: pass --db URL, set ELASTIC_DB_URL, or db in --config")
    secret = check_secret(config)
    threads = int(config.get("THREADS") or DEFAULT_THREADS)
    lifetime = int(config.get("SESSION_LIFETIME_S") or DEFAULT_SESSION_LIFETIME_S)
    app = Flask(__name__, template_folder=str(TEMPLATES), static_folder="static")
    app.config.update(SESSION_COOKIE_HTTPONLY=True, SESSION_COOKIE_SAMESITE="Lax", POLL_SECONDS=2,
                      SESSION_COOKIE_SECURE=bool(config.get("SECURE_COOKIES")),
                      PERMANENT_SESSION_LIFETIME=timedelta(seconds=lifetime),
                      MAX_CONTENT_LENGTH=MAX_REQUEST_BYTES, MAX_FORM_MEMORY_SIZE=MAX_REQUEST_BYTES)
    app.config.update({k: v for k, v in config.items() if k not in ("HOST", "PORT")})
    app.config["SECRET_KEY"] = secret
    # One connection per server thread, so a burst waits for a thread instead of exhausting the pool.
    app.extensions["elastic_store"] = Store(config["DB_URL"], upgrade_schema=False, pool_size=threads)
    security.init_app(app)
    throttle.init_app(app, api.bp)
    auth.init_app(app, api.bp)
    views.init_app(app)
    actions.init_app(app)
    cluster_views.init_app(app)
    audit.init_app(app)
    events.init_app(app)
    api.init_app(app)
    return app
