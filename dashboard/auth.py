"""Login/logout, the logged-in user, role checks and CSRF protection, on Flask's extensions.

Everything but /login and static files needs a logged-in user (Flask-Login); every POST needs the
session's CSRF token (Flask-WTF's CSRFProtect: form field csrf_token or header X-CSRF-Token, which htmx
sends). A session carries the user's session version in its id: logout and password changes bump it, so a
cookie copied before then stops working (sessions are signed cookies, not server-side). The service's API
(service.api) proves its callers by munge instead, and is exempt from both.
"""
from __future__ import annotations

import pwd
from functools import wraps
from typing import Any, Callable, TypeVar, cast
from urllib.parse import urlsplit

from flask import Blueprint, Flask, Response, abort, current_app, g, redirect, render_template, request, session, url_for
from flask_login import LoginManager, UserMixin, current_user, login_user, logout_user
from flask_wtf.csrf import CSRFError, CSRFProtect
from werkzeug.exceptions import BadRequest

from dashboard.deps import is_htmx, store
from dashboard.security import client_address
from db.vocab import MAX_NAME, MAX_PASSWORD
from service.identity import caller_of

bp = Blueprint("auth", __name__)
F = TypeVar("F", bound=Callable[..., Any])
PUBLIC_ENDPOINTS = {"auth.login", "static"}
MAX_NEXT = 2000


class SessionUser(UserMixin):
    """A dashboard user in a session: its id names the user and its session version, so a revoked session
    (logout, password change) no longer loads."""

    def __init__(self, user: Any) -> None:
        self.user = user
        self.name, self.role, self.is_admin = user.name, user.role, user.is_admin

    def get_id(self) -> str:
        return f"{self.user.session_version}:{self.name}"


def _load_session_user(user_id: str) -> SessionUser | None:
    version, _, name = user_id.partition(":")
    user = store().get_user(name) if name else None
    if user is None or str(user.session_version) != version:
        return None  # logged out elsewhere, or the password changed: this cookie is dead
    return SessionUser(user)


def audit(action: str, target: str, result: str) -> None:
    """An audit row for this request: the user (or anonymous) and the client address."""
    who = g.user.name if getattr(g, "user", None) else "anonymous"
    store().audit(who, action, target, result, client_address())
    g.audited = True


def _csrf_failed(exc: CSRFError) -> Any:
    """Audited (at most CSRF_AUDIT_LIMIT rows per address per window), then the error page."""
    if current_app.extensions["elastic_throttle"]["csrf_audit"].failed(client_address()):
        audit("csrf", request.path, f"denied: missing or wrong CSRF token on {request.method} ({exc.description})")
    return current_app.handle_http_exception(
        BadRequest(description="missing or wrong CSRF token: reload the page and try again"))


def _proxy_user() -> Any:
    """LOGIN=proxy: the user a trusted reverse proxy authenticated (its REMOTE_USER header, PROXY_USER_HEADER),
    believed only from the proxy's own addresses (PROXY_ADDRESSES); a header from anywhere else is ignored,
    audited once per request, and the request is as if anonymous."""
    header = current_app.config.get("PROXY_USER_HEADER") or "X-Remote-User"
    name = (request.headers.get(header) or "").strip()
    if not name:
        return None
    if client_address() not in set(current_app.config.get("PROXY_ADDRESSES") or ()):
        store().audit(name[:MAX_NAME], "login", "dashboard", f"denied: {header} from {client_address()}, which is "
                      "not a configured proxy address", client_address())
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    return SessionUser(_site_row(entry))


def _site_row(entry: pwd.struct_passwd) -> Any:
    """The dashboard's row of a Unix user the site proved: admin for members of OPERATORS_GROUP (and root),
    viewer otherwise -- a viewer still acts on the jobs they own (dashboard.actions)."""
    operator = caller_of(entry.pw_uid, entry.pw_gid, current_app.config.get("OPERATORS_GROUP"),
                         current_app.config.get("SLURM_OPERATOR")).operator
    role = "admin" if operator else "viewer"
    known = store().get_user(entry.pw_name)  # a proxied user comes on every request: write only what changed
    return known if known is not None and known.role == role else store().site_user(entry.pw_name, role)


def _load_user() -> Response | None:
    if request.blueprint == "api":  # the service's API proves its callers by munge (service.api), not cookies
        g.user = None
        return None
    g.user = _proxy_user() if current_app.config.get("LOGIN") == "proxy" else \
        current_user if current_user.is_authenticated else None
    if request.method == "POST":
        current_app.extensions["csrf"].protect()  # after g.user, so a failure is audited with the user
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
            target = f"job:{kwargs['job_id']}" if "job_id" in kwargs else request.path
            audit(request.path.rsplit("/", 1)[-1], target, "denied: admin role required")
            abort(403, description="this action needs the admin role")
        return view(*args, **kwargs)

    return cast(F, wrapper)


def safe_next(value: str | None) -> str:
    """Only same-site paths, so the login form cannot redirect off-site.

    Browsers drop TAB/CR/LF inside URLs and read `\\` as `/`, so `/<TAB>/evil` and `/\\evil` mean
    `//evil` (another host): any control character, space or backslash is refused outright."""
    fallback = url_for("views.jobs")
    if not value or len(value) > MAX_NEXT or not value.startswith("/") or value.startswith("//"):
        return fallback
    if "\\" in value or any(ord(c) < 0x21 or ord(c) == 0x7F for c in value):
        return fallback
    parts = urlsplit(value)
    return value if not parts.scheme and not parts.netloc else fallback


def site_login(name: str, password: str) -> Any:
    """A login checked by the host's PAM (service `PAM_SERVICE`, default `login`: the cluster's own accounts,
    LDAP included where PAM reaches it): the user's dashboard row (_site_row)."""
    import pam

    if not pam.authenticate(name, password, service=current_app.config.get("PAM_SERVICE") or "login"):
        return None
    try:
        return _site_row(pwd.getpwnam(name))
    except KeyError:
        return None


def _refuse(status: int, error: str, headers: dict[str, str] | None = None) -> Any:
    page = render_template("login.html", next=safe_next(request.form.get("next")), error=error)
    return page, status, headers or {}


@bp.route("/login", methods=["GET", "POST"])
def login() -> Any:
    if request.method == "GET":
        return render_template("login.html", next=safe_next(request.args.get("next")), error=None)
    name = request.form.get("username", "").strip()
    password = request.form.get("password", "")
    if not name or len(name) > MAX_NAME or len(password) > MAX_PASSWORD:
        return _refuse(400, f"user name (1..{MAX_NAME}) or password (up to {MAX_PASSWORD} characters) out of bounds")
    windows, address = current_app.extensions["elastic_throttle"], client_address()
    wait = max(windows["user"].retry_after(name), windows["address"].retry_after(address))
    if wait:
        return _refuse(429, f"too many failed logins: try again in {wait} s", {"Retry-After": str(wait)})
    with current_app.extensions["elastic_hash_slots"]:
        user = site_login(name, password) if current_app.config.get("LOGIN") == "pam" else \
            store().verify_user(name, password)
    store().audit(name, "login", "dashboard", "ok" if user else "denied: bad credentials", address)
    if user is None:
        windows["user"].failed(name)
        windows["address"].failed(address)
        return _refuse(401, "wrong user name or password")
    windows["user"].forget(name)
    session.clear()  # new session on login: no fixation, fresh CSRF token
    session.permanent = True  # expires after PERMANENT_SESSION_LIFETIME (the signature's age is checked too)
    login_user(SessionUser(user))
    return redirect(safe_next(request.form.get("next")))


@bp.route("/logout", methods=["POST"])
def logout() -> Any:
    audit("logout", "dashboard", "ok")
    store().revoke_sessions(g.user.name)  # every cookie of this user, including copies, stops working
    logout_user()
    session.clear()
    return redirect(url_for("auth.login"))


def init_app(app: Flask, api_blueprint) -> None:
    logins = LoginManager(app)
    logins.user_loader(_load_session_user)
    app.config.update(WTF_CSRF_TIME_LIMIT=None, WTF_CSRF_CHECK_DEFAULT=False)  # the session's own token, checked
    csrf = CSRFProtect(app)                                                   # in _load_user (after g.user)
    csrf.exempt(api_blueprint)
    app.extensions["csrf"] = csrf
    app.register_error_handler(CSRFError, _csrf_failed)
    app.before_request(_load_user)
    app.register_blueprint(bp)
