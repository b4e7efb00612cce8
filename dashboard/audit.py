"""GET /audit: the audit log for admins (who, what, target, result, address, time), filterable
by exact who/action/target/address and a time range, newest first, one page at a time."""
from __future__ import annotations

from typing import Any

from flask import Blueprint, Flask, abort, render_template, request

from dashboard.auth import admin_required
from dashboard.deps import is_htmx, store
from db.filters import parse_int, parse_time
from db.store_admin import AuditFilters
from db.vocab import MAX_NAME

bp = Blueprint("audit", __name__)
PAGE_SIZE = 50
TEXT_KEYS = ("who", "action", "target", "address")


def _filters() -> tuple[AuditFilters, dict[str, str]]:
    """Typed filters and the (known, non-empty) query values to carry into paging links."""
    args = {k: v for k in (*TEXT_KEYS, "since", "until") if (v := request.args.get(k, "").strip())}
    if any(len(v) > MAX_NAME for v in args.values()):
        raise ValueError(f"filter values are at most {MAX_NAME} characters")
    since = parse_time(args["since"]) if "since" in args else None
    until = parse_time(args["until"], end_of_day=True) if "until" in args else None
    return AuditFilters(**{k: args.get(k) for k in TEXT_KEYS}, since=since, until=until), args


@bp.get("/audit")
@admin_required
def audit_page() -> Any:
    try:
        filters, args = _filters()
        page = parse_int("page", request.args.get("page", "1"), 1, 10**6)
    except ValueError as exc:
        abort(400, description=str(exc))
    rows = store().audit_log(PAGE_SIZE, filters=filters, offset=(page - 1) * PAGE_SIZE)
    total = store().audit_count(filters)
    ctx = {"rows": rows, "args": args, "page": page, "pages": max(1, -(-total // PAGE_SIZE)), "total": total}
    return render_template("_audit_table.html" if is_htmx() else "audit.html", **ctx)


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
