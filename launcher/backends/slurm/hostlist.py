"""Slurm host lists: `n[1-3,5],gpu01` <-> ['n1', 'n2', 'n3', 'n5', 'gpu01'].

Pure, with no import from the rest of the launcher, so the dashboard reads Slurm's node lists with
the very same code as the launcher.
"""
from __future__ import annotations

import re
from typing import Iterable

_HOST_RANGE = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<body>[^\[\]]+)\](?P<suffix>[^\[\]]*)$")


def expand_hostlist(expr: str) -> list[str]:
    """`n[1-3,5],gpu01` -> ['n1', 'n2', 'n3', 'n5', 'gpu01'] (zero padding kept).

    Handles one bracket group per host pattern, which is what Slurm prints.
    """
    expr = expr.strip()
    if not expr or expr == "(null)":
        return []
    hosts: list[str] = []
    for item in _split_top_level(expr):
        match = _HOST_RANGE.match(item)
        if not match:
            if "[" in item or "]" in item:
                raise ValueError(f"cannot expand host list {expr!r}: bad item {item!r}")
            hosts.append(item)
            continue
        prefix, suffix = match["prefix"], match["suffix"]
        for part in match["body"].split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"cannot expand host list {expr!r}: bad range {part!r}")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def _split_top_level(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, current = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    items.append("".join(current))
    return [i for i in items if i]


_HOST_NUMBER = re.compile(r"^(?P<prefix>.*?)(?P<num>\d+)$")


def compress_hostlist(nodes: Iterable[str]) -> str:
    """['n1', 'n2', 'n3', 'n5'] -> 'n[1-3,5]'; prefixes in order of first appearance.

    A single host stays bare (`n1`, not `n[1]`) so commands read naturally.
    Zero padding is kept: ['gpu08', 'gpu09', 'gpu10'] -> 'gpu[08-10]'.
    """
    numbers: dict[str, list[int]] = {}
    widths: dict[str, int] = {}
    order: list[tuple[str, str]] = []  # ("bare", host) or ("group", prefix)
    for node in nodes:
        match = _HOST_NUMBER.match(node)
        if not match:
            if ("bare", node) not in order:
                order.append(("bare", node))
            continue
        prefix, digits = match["prefix"], match["num"]
        if prefix not in numbers:
            numbers[prefix], widths[prefix] = [], 0
            order.append(("group", prefix))
        if digits.startswith("0") and len(digits) > 1:
            widths[prefix] = max(widths[prefix], len(digits))
        if int(digits) not in numbers[prefix]:
            numbers[prefix].append(int(digits))
    return ",".join(
        item if kind == "bare" else _compress_group(item, widths[item], sorted(numbers[item]))
        for kind, item in order
    )


def _compress_group(prefix: str, width: int, numbers: list[int]) -> str:
    fmt = (lambda n: f"{n:0{width}d}") if width else str
    if len(numbers) == 1:
        return f"{prefix}{fmt(numbers[0])}"
    ranges, start, prev = [], numbers[0], numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        ranges.append(fmt(start) if start == prev else f"{fmt(start)}-{fmt(prev)}")
        if n is not None:
            start = prev = n
    return f"{prefix}[{','.join(ranges)}]"
