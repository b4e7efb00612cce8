"""Parse and validate `history` filters given as text (CLI flags or query strings).

Both `elastic history` and the dashboard's /history page go through `parse_history_filters`,
so a malformed value is rejected with the same message everywhere and only typed values
(datetimes, ints, vocabulary words) ever reach `Store.history`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import date, datetime, time, timezone
from typing import Any, Mapping

from db.vocab import MAX_ID, MAX_NAME, MIGRATION_STATUSES, MIGRATION_TRIGGERS

MAX_LIMIT = 1000


@dataclass(frozen=True)
class HistoryFilters:
    """Typed arguments for `Store.history` / `Store.history_count`."""

    job: int | str | None = None
    since: datetime | None = None
    until: datetime | None = None
    trigger: str | None = None
    status: str | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Store.history(**filters.as_kwargs())."""
        return asdict(self)


def parse_time(text: str, *, end_of_day: bool = False) -> datetime:
    """Parse an ISO date or datetime; naive values are taken as UTC.

    A bare date as an upper bound means the end of that day, so `--until 2024-05-01`
    includes migrations on May 1st.
    """
    text = text.strip()
    shown = text if len(text) <= 40 else text[:40] + "…"
    try:
        if not text.isascii():  # fromisoformat takes non-ASCII digits; a time is plain ASCII
            raise ValueError(text)
        if len(text) == 10:
            d = date.fromisoformat(text)
            t = time.max if end_of_day else time.min
            return datetime.combine(d, t, tzinfo=timezone.utc)
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
        # Convert now: an offset at the ends of the calendar (0001-01-01T00:00+01:00) overflows here,
        # not later inside the query.
        return value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)
    except (ValueError, OverflowError):
        raise ValueError(
            f"bad time {shown!r}: use an ISO date like 2024-05-01 or 2024-05-01T13:00:00"
        ) from None


def parse_job(text: str) -> int | str:
    """A job is given by numeric id or by name."""
    text = text.strip()
    if not text:
        raise ValueError("empty job: give a job id or name")
    if text.isascii() and text.isdigit():
        if len(text) > 19 or int(text) > MAX_ID:
            raise ValueError(f"bad job id {text[:40]!r}: no job has an id that large")
        return int(text)
    if len(text) > MAX_NAME:
        raise ValueError(f"job name too long (max {MAX_NAME} characters)")
    return text


def parse_int(name: str, text: str, lo: int, hi: int) -> int:
    """Parse a bounded integer (page numbers, limits) with a message naming the field."""
    try:
        if not (isinstance(text, str) and text.strip().isascii() and len(text) <= 20):
            raise ValueError(text)
        value = int(text)
    except (TypeError, ValueError):
        shown = text[:40] if isinstance(text, str) else text
        raise ValueError(f"bad {name} {shown!r}: expected a whole number") from None
    if not lo <= value <= hi:
        raise ValueError(f"bad {name} {value}: expected {lo}..{hi}")
    return value


def parse_history_filters(raw: Mapping[str, str | None]) -> HistoryFilters:
    """Turn textual filters (empty or missing = no filter) into HistoryFilters.

    Raises ValueError with a one-line, user-facing message on malformed input.
    """

    def get(key: str) -> str | None:
        value = raw.get(key)
        return value.strip() if isinstance(value, str) and value.strip() else None

    job = get("job")
    since = get("since")
    until = get("until")
    trigger = get("trigger")
    status = get("status")
    if trigger is not None and trigger not in MIGRATION_TRIGGERS:
        raise ValueError(f"bad trigger {trigger!r}: expected one of {', '.join(MIGRATION_TRIGGERS)}")
    if status is not None and status not in MIGRATION_STATUSES:
        raise ValueError(f"bad status {status!r}: expected one of {', '.join(MIGRATION_STATUSES)}")
    filters = HistoryFilters(
        job=parse_job(job) if job else None,
        since=parse_time(since) if since else None,
        until=parse_time(until, end_of_day=True) if until else None,
        trigger=trigger,
        status=status,
    )
    if filters.since and filters.until and filters.since > filters.until:
        raise ValueError("bad time range: --since is after --until")
    return filters
