"""Issue 12's attacks, each a request that used to succeed (or crash) and now may not."""
from __future__ import annotations

import re
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import pytest
from flask import Flask

from dashboard import create_app
from db import Store
from tests.dashboard.conftest import PASSWORDS, SECRET, csrf_of, login


def _post_login(client: Any, user: str, password: str, **extra: str) -> Any:
    token = csrf_of(client.get("/login").text)
    return client.post("/login", data={"username": user, "password": password, "csrf_token": token, **extra})


# ------------------------------------------------------------------ open redirect (item 1)
@pytest.mark.parametrize("target", [
    "/\t/evil.example/phish", "/\n/evil.example", "/\r\n/evil.example", "/\\evil.example", "/\\/evil.example",
    "//evil.example/", "https://evil.example/", "/ /evil.example", "\t//evil.example", "/\x0b/evil.example",
])
def test_login_next_never_leaves_the_site(anon: Any, target: str) -> None:
    resp = _post_login(anon, "admin", PASSWORDS["admin"], next=target)
    assert resp.status_code == 302 and resp.headers["Location"] == "/"


def test_login_next_keeps_a_local_path(anon: Any) -> None:
    resp = _post_login(anon, "admin", PASSWORDS["admin"], next="/history?job=llama")
    assert resp.headers["Location"] == "/history?job=llama"


def test_login_form_never_echoes_an_offsite_next(anon: Any) -> None:
    text = anon.get("/login?next=%2F%09%2Fevil.example").text
    assert 'name="next" value="/"' in text and "evil" not in text


# ------------------------------------------------------------------ sessions (item 3)
def _cookie(client: Any) -> str:
    return client.get_cookie("session").value


def test_cookie_saved_before_logout_is_dead_after_logout(app: Flask, admin: Any) -> None:
    saved = _cookie(admin)
    assert admin.post("/logout", data={"csrf_token": admin.csrf}).status_code == 302
    thief = app.test_client()
    thief.set_cookie("session", saved)
    resp = thief.get("/")
    assert resp.status_code == 302 and "/login" in resp.headers["Location"]


def test_password_change_revokes_existing_sessions(app: Flask, admin: Any, store: Store) -> None:
    assert admin.get("/").status_code == 200
    store.add_user("admin", "a-new-password", "admin", replace=True)
    assert admin.get("/").status_code == 302
    assert _post_login(app.test_client(), "admin", "a-new-password").status_code == 302


def test_secure_cookies_and_lifetime(db_url: str) -> None:
    app = create_app({"DB_URL": db_url, "SECRET_KEY": SECRET, "TESTING": True, "SECURE_COOKIES": True,
                      "SESSION_LIFETIME_S": 600})
    client = app.test_client(use_cookies=True)
    resp = _post_login(client, "viewer", PASSWORDS["viewer"])
    cookie = resp.headers["Set-Cookie"]
    assert "; Secure" in cookie and "HttpOnly" in cookie
    expires = parsedate_to_datetime(re.search(r"Expires=([^;]+)", cookie).group(1))  # type: ignore[union-attr]
    assert 590 <= (expires - datetime.now(timezone.utc)).total_seconds() <= 601
    default = create_app({"DB_URL": db_url, "SECRET_KEY": SECRET, "TESTING": True})
    assert default.permanent_session_lifetime.total_seconds() == 8 * 3600
    assert not default.config["SESSION_COOKIE_SECURE"]


# ------------------------------------------------------------------ login abuse (item 4)
def test_login_throttled_per_user_even_with_the_right_password(anon: Any, store: Store) -> None:
    for _ in range(5):
        assert _post_login(anon, "admin", "wrong").status_code == 401
    resp = _post_login(anon, "admin", PASSWORDS["admin"])
    assert resp.status_code == 429 and int(resp.headers["Retry-After"]) > 0
    assert _post_login(anon, "viewer", PASSWORDS["viewer"]).status_code == 302  # other users unaffected


def test_login_throttled_per_address_across_user_names(db_url: str) -> None:
    app = create_app({"DB_URL": db_url, "SECRET_KEY": SECRET, "TESTING": True, "LOGIN_ADDRESS_LIMIT": 3})
    client = app.test_client()
    for i in range(3):
        assert _post_login(client, f"guess{i}", "x").status_code == 401
    assert _post_login(client, "viewer", PASSWORDS["viewer"]).status_code == 429
    other = app.test_client()
    other.environ_base["REMOTE_ADDR"] = "10.0.0.9"
    assert _post_login(other, "viewer", PASSWORDS["viewer"]).status_code == 302


def test_unknown_user_costs_a_password_hash_like_a_known_one(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    import db.store_admin as sa

    checked: list[str] = []
    real = sa.check_password_hash
    monkeypatch.setattr(sa, "check_password_hash", lambda h, p: checked.append(h.split("$")[0]) or real(h, p))
    assert store.verify_user("nobody", "x") is None and store.verify_user("admin", "x") is None
    assert len(checked) == 2 and checked[0] == checked[1]  # the same method and cost for both


def test_huge_user_names_are_refused_without_growing_the_audit_log(anon: Any, store: Store) -> None:
    before = store.audit_count()
    assert _post_login(anon, "u" * 201, "x").status_code == 400
    assert _post_login(anon, "u" * 400_000, "x").status_code == 413  # over the request size bound
    assert store.audit_count() == before


def test_audit_fields_are_bounded(store: Store) -> None:
    rid = store.audit("w" * 5000, "a" * 2000, "t" * 5000, "r" * 100_000, "1" * 500)
    (row,) = [r for r in store.audit_log(5) if r.id == rid]
    assert (len(row.who), len(row.action), len(row.target), len(row.result), len(row.address)) == (200, 64, 200, 2000, 64)


def test_add_user_bounds_names_and_passwords(store: Store) -> None:
    with pytest.raises(ValueError, match="at most 200"):
        store.add_user("n" * 201, "password1")
    with pytest.raises(ValueError, match="too long"):
        store.add_user("ok", "p" * 2000)


# ------------------------------------------------------------------ CSV injection (item 5)
def test_history_csv_neutralises_formulas(viewer: Any, store: Store) -> None:
    evil = store.create_job("=HYPERLINK(\"http://evil\")", "pp1tp1dp1", 1, 1)
    mid = store.start_migration(evil, "+cmd", "-x", "demo", {}, {})
    store.finish_migration(mid, "failed", None, None, None, {}, error="@SUM(1)")
    text = viewer.get("/history?format=csv").text
    assert "'=HYPERLINK" in text and ",'+cmd,'-x," in text and "'@SUM(1)" in text
    assert not re.search(r"(^|,)[=+\-@]", text.replace(",-", "", 0))


# ------------------------------------------------------------------ no 500s (item 6)
@pytest.mark.parametrize("url, status", [
    ("/jobs/9223372036854775808", 404), ("/jobs/99999999999999999999999", 404), ("/migrations/18446744073709551616", 404),
    ("/jobs/\u0661", 404), ("/jobs/0", 404),
    ("/history?job=99999999999999999999", 400), ("/history?since=0001-01-01T00:00:00%2B01:00", 400),
    ("/history?until=9999-12-31T23:59:59-01:00", 400), ("/history?since=\u0662\u0660\u0662\u0664-01-01", 400),
    ("/history?page=\u0661", 400), ("/history?job=%C2%B2", 200),
    ("/history?endpoint=x", 200), ("/history?_method=POST", 200), ("/history?_external=1&_scheme=https", 200),
])
def test_hostile_urls_answer_4xx_not_500(viewer: Any, url: str, status: int) -> None:
    resp = viewer.get(url)
    assert resp.status_code == status, resp.text[:300]
    assert "Traceback" not in resp.text and "ValueError" not in resp.text


def test_unknown_query_keys_never_reach_links(viewer: Any) -> None:
    viewer.set_cookie("session", _cookie(viewer), domain="evil.example")  # as if the Host were forged
    text = viewer.get("/history?_external=1&job=llama&evil=1", headers={"Host": "evil.example"}).text
    assert "evil.example" not in text and "evil=1" not in text
    assert 'href="/history?format=csv&amp;job=llama"' in text


def test_admin_post_with_huge_id_is_404_and_audited(admin: Any, store: Store) -> None:
    resp = admin.post("/jobs/99999999999999999999/suspend", data={"csrf_token": admin.csrf})
    assert resp.status_code == 404
    row = store.audit_log(1)[0]
    assert row.who == "admin" and "404" in row.result and row.address == "127.0.0.1"


# ------------------------------------------------------------------ audit (item 9)
def test_csrf_failures_and_admin_404s_are_audited_with_address(admin: Any, store: Store) -> None:
    assert admin.post("/jobs/1/suspend", data={"csrf_token": "forged"}).status_code == 400
    csrf_row = store.audit_log(1)[0]
    assert (csrf_row.who, csrf_row.action, csrf_row.address) == ("admin", "csrf", "127.0.0.1")
    assert admin.post("/jobs/1/" + "x" * 2000, data={"csrf_token": admin.csrf}).status_code == 404
    row = store.audit_log(1)[0]
    assert len(row.action) == 64 and "no such action" in row.result
    assert admin.post("/jobs/4242/suspend", data={"csrf_token": admin.csrf}).status_code == 404
    assert "no such job" in store.audit_log(1)[0].result


def test_audit_page_is_admin_only_and_filterable(admin: Any, viewer: Any, store: Store) -> None:
    store.audit("mallory", "preempt", "job:1", "denied: admin role required", "10.1.2.3")
    assert viewer.get("/audit").status_code == 403
    page = admin.get("/audit?who=mallory")
    assert page.status_code == 200 and "10.1.2.3" in page.text and "1 row" in page.text
    assert 'data-audit-id' in page.text and "login" not in page.text.split('id="audit-table"')[1]
    assert "No audit rows match" in admin.get("/audit?address=192.0.2.1").text
    assert admin.get("/audit?since=nope").status_code == 400
    assert admin.get("/audit?who=" + "x" * 300).status_code == 400


# ------------------------------------------------------------------ headers (item 10)
@pytest.mark.parametrize("url", ["/login", "/", "/jobs/1", "/static/style.css"])
def test_security_headers(viewer: Any, url: str) -> None:
    resp = viewer.get(url)
    csp = resp.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-eval" not in csp and "frame-ancestors 'none'" in csp
    assert resp.headers["X-Frame-Options"] == "DENY" and resp.headers["X-Content-Type-Options"] == "nosniff"
