"""History exports shared by `elastic history` (--csv, --json, --rank-maps) and the dashboard's
/history?format=csv and /jobs/<id>/rank-maps.

Spreadsheets run a cell that starts with = + - @ (or a tab/CR that hides one) as a formula, so a
job name like `=HYPERLINK(...)` must not reach a CSV as it is: such text cells get a leading
apostrophe (OWASP's advice). Numbers stay numbers.
"""
from __future__ import annotations

import csv
from typing import Any, Iterable, Mapping, TextIO

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n")

#: One row per rank and epoch: where each rank ran (het-job component, node, GPU) and its coordinates.
RANK_MAP_COLUMNS = ("job_id", "epoch", "layout", "started_at", "ended_at", "virtual_rank", "component", "node",
                    "gpu", "pp", "dp", "tp")


def rank_map_rows(maps: Iterable[Any]) -> list[dict[str, Any]]:
    """db.records.RankMap epochs -> flat JSON/CSV-ready rows (RANK_MAP_COLUMNS), epoch then rank order."""
    return [{"job_id": m.job_id, "epoch": m.epoch, "layout": m.layout, "started_at": m.started_at.isoformat(),
             "ended_at": m.ended_at.isoformat() if m.ended_at else None, "virtual_rank": e.virtual_rank,
             "component": e.component, "node": e.node, "gpu": e.gpu, "pp": e.pp, "dp": e.dp, "tp": e.tp}
            for m in maps for e in sorted(m.entries, key=lambda e: e.virtual_rank)]


def csv_cell(value: Any) -> Any:
    """The value as a CSV cell that no spreadsheet will evaluate; a list (a migration's notes) is one
    cell, its items joined by "; "."""
    if isinstance(value, (list, tuple)):
        value = "; ".join(map(str, value))
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def write_csv(rows: Iterable[Mapping[str, Any]], columns: Iterable[str], out: TextIO) -> None:
    """Header row, then one neutralised row per mapping, "\\n" line ends."""
    names = list(columns)
    writer = csv.DictWriter(out, fieldnames=names, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: csv_cell(r.get(k)) for k in names} for r in rows)
