"""History exports shared by `elastic history --csv` and the dashboard's /history?format=csv.

Spreadsheets run a cell that starts with = + - @ (or a tab/CR that hides one) as a formula, so a
job name like `=HYPERLINK(...)` must not reach a CSV as it is: such text cells get a leading
apostrophe (OWASP's advice). Numbers stay numbers.
"""
from __future__ import annotations

import csv
from typing import Any, Iterable, Mapping, TextIO

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n")


def csv_cell(value: Any) -> Any:
    """The value as a CSV cell that no spreadsheet will evaluate."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def write_csv(rows: Iterable[Mapping[str, Any]], columns: Iterable[str], out: TextIO) -> None:
    """Header row, then one neutralised row per mapping, "\\n" line ends."""
    names = list(columns)
    writer = csv.DictWriter(out, fieldnames=names, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: csv_cell(r.get(k)) for k in names} for r in rows)
