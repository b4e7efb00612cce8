"""MkDocs hook (mkdocs.yml `hooks:`): the reference pages are generated from the code itself when the site is
built, so they cannot drift from it.

A page asks for a generated part with an HTML comment on a line of its own:

    <!-- generate: cli -->                    every `elastic` command and `elastic-launch`, from their argparse parsers
    <!-- generate: schema -->                 every table of db/models.py: columns, types, keys, indexes, comments
    <!-- generate: layouts pp4tp2 tp2fsdp4 --> each layout as migrate.layout.ParallelConfig.parse reads it
    <!-- generate: layout-errors pp2pp2 tp -->  what ParallelConfig.parse says about each of these

Run alone (`python scripts/docs_hooks.py cli|schema`) it prints the part, for a look without building the site.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MARK = re.compile(r"^<!-- generate: ([\w-]+)((?: [^ \n]+)*) -->$", re.M)
WIDTH = 100  # argparse wraps help to $COLUMNS: fixed, so a build does not depend on the terminal


def _help(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        return parser.format_help().rstrip()
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """Every command's --help, as the installed parsers print it: `elastic-launch` (launcher.options), then each
    `elastic` subcommand (launcher.cli.build_parser, in its own order)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from launcher.cli import build_parser as elastic_parser
    from launcher.options import build_parser as launch_parser

    def section(title: str, parser: argparse.ArgumentParser, anchor: str) -> str:
        return f"## `{title}` {{#{anchor}}}\n\n```text\n{_help(parser)}\n```\n"

    top = elastic_parser()
    parts = [section("elastic-launch", launch_parser(), "elastic-launch"), section("elastic", top, "elastic")]
    for name, sub in _subparsers(top).items():
        parts.append(section(f"elastic {name}", sub, f"elastic-{name}"))
    return "\n".join(parts)


def _column_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, attribute) -> the comment at the end of its line in db/models.py (what a version added, why)."""
    out, cls = {}, None
    for line in source.splitlines():
        m = re.match(r"class (\w+)\(", line)
        if m:
            cls = m.group(1)
        m = re.match(r"\s+(\w+): Mapped\[.*#\s*(.+)$", line)
        if m and cls:
            out[(cls, m.group(1))] = m.group(2).strip()
    return out


def schema_reference() -> str:
    """The current schema from db.models' SQLAlchemy metadata, one table per section."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from db import models

    comments = _column_comments((ROOT / "db" / "models.py").read_text())
    by_table = {m.local_table.name: m for m in models.Base.registry.mappers}
    parts = []
    for table in models.Base.metadata.sorted_tables:
        mapper = by_table.get(table.name)
        cls = mapper.class_ if mapper is not None else None
        parts.append(f"### `{table.name}`\n")
        doc = (cls.__doc__ or "").strip() if cls is not None else ""
        if doc and cls.__doc__ is not models.Base.__doc__:
            parts.append(" ".join(doc.split()) + "\n")
        parts.append("| column | type | null | key | note |\n|---|---|---|---|---|")
        attr = {c.name: k for k, c in mapper.columns.items()} if mapper is not None else {}
        for col in table.columns:
            keys = ["primary key"] if col.primary_key else []
            keys += [f"→ `{fk.target_fullname}`" for fk in col.foreign_keys]
            if col.index:
                keys.append("indexed")
            note = comments.get((cls.__name__, attr.get(col.name, col.name)), "") if cls is not None else ""
            parts.append(f"| `{col.name}` | {col.type} | {'yes' if col.nullable else 'no'} | {', '.join(keys)} | "
                         f"{note.replace('|', '/')} |")
        extra = [ix for ix in table.indexes if len(ix.columns) > 1 or not next(iter(ix.columns)).index]
        extra_lines = [f"- index `{ix.name}` on ({', '.join(c.name for c in ix.columns)})"
                       f"{' (unique)' if ix.unique else ''}" for ix in sorted(extra, key=lambda i: i.name or "")]
        from sqlalchemy import UniqueConstraint

        extra_lines += [f"- unique ({', '.join(c.name for c in uc.columns)})" for uc in table.constraints
                        if isinstance(uc, UniqueConstraint)]
        parts.append(("\n" + "\n".join(extra_lines) + "\n") if extra_lines else "")
    return "\n".join(parts)


def layouts_table(texts: list[str]) -> str:
    """How migrate.layout.ParallelConfig.parse reads each layout: its sizes, world size and the ranks of stage 0."""
    from migrate.layout import ParallelConfig

    rows = ["| you write | pp | dp | fsdp | tp | devices | normal form |", "|---|---|---|---|---|---|---|"]
    for text in texts:
        c = ParallelConfig.parse(text)
        rows.append(f"| `{text}` | {c.pp} | {c.dp} | {c.fsdp} | {c.tp} | {c.world_size} | `{c}` |")
    return "\n".join(rows)


def layout_errors(texts: list[str]) -> str:
    """What ParallelConfig.parse answers for layouts it cannot read."""
    from migrate.layout import LayoutError, ParallelConfig

    rows = ["| you write | the error |", "|---|---|"]
    for text in texts:
        try:
            ParallelConfig.parse(text)
        except LayoutError as exc:
            rows.append(f"| `{text}` | {str(exc).replace('|', '/')} |")
        else:
            raise ValueError(f"docs: layout-errors lists {text!r}, which parses")
    return "\n".join(rows)


def generate(kind: str, args: list[str]) -> str:
    if kind == "cli":
        return cli_reference()
    if kind == "schema":
        return schema_reference()
    if kind == "layouts":
        return layouts_table(args)
    if kind == "layout-errors":
        return layout_errors(args)
    raise ValueError(f"docs: unknown generated part {kind!r} (cli, schema, layouts, layout-errors)")


def expand(markdown: str) -> str:
    """The page with every `<!-- generate: ... -->` line replaced by what it asks for."""
    def one(m: re.Match) -> str:
        with contextlib.redirect_stdout(io.StringIO()):  # an import that prints must not reach the page
            return generate(m.group(1), m.group(2).split())

    return _MARK.sub(one, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:  # MkDocs' hook
    return expand(markdown)


if __name__ == "__main__":
    print(generate(sys.argv[1], sys.argv[2:]))
