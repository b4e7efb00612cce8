"""Web dashboard: Flask app factory, server-rendered Jinja partials swapped by htmx.

Every read and write goes through db.Store; admin actions only queue requests that the
launcher carries out.
"""
from __future__ import annotations

from dashboard.app import create_app
from dashboard.config import ConfigError, load_config

__all__ = ["ConfigError", "create_app", "load_config"]
