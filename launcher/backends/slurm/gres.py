"""Slurm's GRES strings: how many GPUs `gpu:a100:3(IDX:0,2-3)` names, and which.

Pure, for the launcher (GPUs a job holds per node) and the dashboard (which GPU indices are taken)
alike.
"""
from __future__ import annotations

import re

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _gres_items(gres: str) -> list[str]:
    """Split a gres string at the commas that are not inside parentheses."""
    items, depth, cur = [], 0, ""
    for ch in gres or "":
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return [i for i in items + [cur] if i]


def _gres_fields(item: str) -> tuple[str, int, str]:
    """`gpu:a100:3(IDX:0,2-3)` -> ("gpu", 3, "IDX:0,2-3")."""
    head, _, rest = item.partition("(")
    fields = head.split(":")
    count = int(fields[-1]) if len(fields) >= 2 and fields[-1].isdigit() else 0
    return fields[0], count, rest.rstrip(")")


def gres_count(gres: str, kind: str = "gpu") -> int:
    """GPUs in a gres string: `gpu:4`, `gpu:a100:4(S:0-1)`, `gpu:2,shard:8` -> 4, 4, 2; none -> 0."""
    return sum(count for name, count, _ in map(_gres_fields, _gres_items(gres)) if name == kind)


def gres_indices(detail: str, kind: str = "gpu") -> tuple[int, ...] | None:
    """GPU indices in a gres_detail entry: `gpu:2(IDX:0-1)` -> (0, 1); `gpu:a100:3(IDX:0,2-3)` ->
    (0, 2, 3); None when it counts GPUs without naming their indices, () when it holds none."""
    found: list[int] = []
    for name, count, inner in map(_gres_fields, _gres_items(detail)):
        if name != kind or not count:
            continue
        idx = re.search(r"IDX:([\d,\-]+)", inner)
        if not idx:
            return None
        for item in idx.group(1).split(","):
            r = _RANGE_RE.match(item)
            if r:
                found.extend(range(int(r.group(1)), int(r.group(2) or r.group(1)) + 1))
    return tuple(sorted(found))
