"""Login/logout, the logged-in user, role checks and CSRF protection.

Everything but /login and static files needs a logged-in user; every POST needs the
session's CSRF token (form field csrf_token or header X-CSRF-Token, which htmx sends).
"""
from __future__ import annotations

import hmac
import secrets
from functools import wraps
from typing import Any, Callable, TypeVar, cast

from flask import Blueprint, Flask, Response, abort, g, redirect, render_template, request, session, url_for

from dashboard.deps import is_htmx, store

bp = Blueprint("auth", __name__)
F = TypeVar("F", bound=Callable[..., Any])
PUBLIC_ENDPOINTS = {"auth.login", "static"}


def csrf_token() -> str:
    """The session's CSRF token, created on first use (templates call this)."""
    if "csrf" not in session:
        session["csrf"] = secrets.token_urlsafe(32)
    return cast(str, session["csrf"])


def _check_csrf() -> None:
    sent = request.form.get("csrf_token") or request.headers.get("X-CSRF-Token") or ""
    expected = session.get("csrf") or ""
    if not expected or not hmac.compare_digest(sent.encode(), expected.encode()):
        abort(400, description="missing or wrong CSRF token: reload the page and try again")


def _load_user() -> Response | None:
    name = session.get("user")
    g.user = store().get_user(name) if name else None
    if request.method == "POST":
        _check_csrf()
    if g.user is None and request.endpoint not in PUBLIC_ENDPOINTS:
        target = url_for("auth.login", next=request.full_path.rstrip("?"))
        if is_htmx():  # a redirect would be swapped into the panel; make htmx navigate instead
            resp = Response("login required", status=401)
            resp.headers["HX-Redirect"] = url_for("auth.login")
            return resp
        return cast(Response, redirect(target))
    return None


def admin_required(view: F) -> F:
    """Viewers may look at everything but get 403 on actions."""

    @wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if g.user is None or not g.user.is_admin:
            target = f"job:{kwargs.get('job_id', '?')}"
            store().audit(g.user.name if g.user else "anonymous", request.path.rsplit("/", 1)[-1], target,
                          "denied: admin role required")
            abort(403, description="this action needs the admin role")
        return view(*args, **kwargs)

    return cast(F, wrapper)


def _safe_next(value: str | None) -> str:
    """Only same-site relative paths, so the login form cannot redirect off-site."""
    if value and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return url_for("views.jobs")


@bp.route("/login", methods=["GET", "POST"])
def login() -> Any:
    if request.method == "GET":
        return render_template("login.html", next=request.args.get("next", ""), error=None)
    name = request.form.get("username", "").strip()
    user = store().verify_user(name, request.form.get("password", ""))
    store().audit(name or "anonymous", "login", "dashboard", "ok" if user else "denied: bad credentials")
    if user is None:
        return render_template("login.html", next=request.form.get("next", ""),
                               error="wrong user name or password"), 401
    session.clear()  # new session on login: no fixation, fresh CSRF token
    session["user"] = user.name
    csrf_token()
    return redirect(_safe_next(request.form.get("next")))


@bp.route("/logout", methods=["POST"])
def logout() -> Any:
    store().audit(g.user.name, "logout", "dashboard", "ok")
    session.clear()
    return redirect(url_for("auth.login"))


def init_app(app: Flask) -> None:
    app.before_request(_load_user)
    app.jinja_env.globals["csrf_token"] = csrf_token
    app.register_blueprint(bp)
