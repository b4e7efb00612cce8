"""`create_app(config)`: wires the Store, auth/CSRF, views and actions together."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from flask import Flask

from dashboard import actions, auth, cluster_views, views
from dashboard.config import ConfigError, check_secret

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


def create_app(config: dict[str, Any]) -> Flask:
    """Build the dashboard app.

    config keys: DB_URL (required), SECRET_KEY (required: refuses to start without it,
    since admin actions and logins depend on signed sessions), POLL_SECONDS (default 2),
    TESTING. Raises ConfigError or db.DatabaseError with a clear message.
    """
    from db import Store

    if not config.get("DB_URL"):
        raise ConfigError("no database configured: pass --db URL, set ELASTIC_DB_URL, or db in --config")
    secret = check_secret(config)
    app = Flask(__name__, template_folder=str(TEMPLATES), static_folder="static")
    app.config.update(SESSION_COOKIE_HTTPONLY=True, SESSION_COOKIE_SAMESITE="Lax", POLL_SECONDS=2)
    app.config.update({k: v for k, v in config.items() if k not in ("HOST", "PORT")})
    app.config["SECRET_KEY"] = secret
    app.extensions["elastic_store"] = Store(config["DB_URL"])
    auth.init_app(app)
    views.init_app(app)
    actions.init_app(app)
    cluster_views.init_app(app)
    return app
