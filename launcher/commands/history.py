"""`elastic history`: query recorded migrations as a table, JSON or CSV.

Filters are parsed by db.filters (shared with the dashboard's /history page) and the rows
come from the same Store.history call, so both show exactly the same thing.
"""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from db.units import human_bytes
from launcher.database import open_store

if TYPE_CHECKING:
    from db.store import Store


def add_db_argument(parser: argparse.ArgumentParser) -> None:
    """--db for every command that reads the elastic database."""
    parser.add_argument("--db", metavar="URL", default=None,
                        help="SQLAlchemy URL or SQLite file path (default: $ELASTIC_DB_URL or "
                             "sqlite:///var/elastic.db)")


FIELDS = """\
fields of --json (and --csv's columns), one object per migration:
  id, job_id, job_name   the migration and its job
  kind                   live (state moved between running workers) or restart (workers stopped, new world)
  trigger                resize, preempt, signal, failure, dashboard, demo, requeue, policy (--policy
                         opportunistic: its reason is in notes)
  status                 succeeded, failed, declined (gave up with nothing wrong), running, planned
  from_layout, to_layout parallel layouts, e.g. pp2tp2dp1
  started_at, finished_at  UTC, ISO 8601
  duration_s             seconds from start to finish
  pause_s                seconds training stood still: last step of the old layout to the first of the new
  <phase>_s              seconds per phase (plan, build_groups, execute, rebuild, other, stop, start)
  bytes_moved            bytes that crossed between processes (null: not measured)
  bytes_checkpoint       what a checkpoint restart would have written and read instead
  bit_exact              every moved piece's digest matched at both ends (null: nothing moved between
                         processes, so nothing was compared; or not checked)
  at_step                the step boundary the new layout went on from (a restore: the checkpoint's step; a
                         restart: the step before the script's first report, launcher.runtime.report_step)
  steps_lost             committed steps run again (a restore from the safety checkpoint; a restart from the
                         script's own checkpoint)
  error                  why it failed or was declined (or what went wrong after the commit)
  notes                  what else happened (node releases, killed workers, a rank's first failure)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = FIELDS
    add_db_argument(parser)
    parser.add_argument("--job", help="job id or name")
    parser.add_argument("--since", help="only migrations started at/after this ISO date or time")
    parser.add_argument("--until", help="only migrations started at/before this ISO date or time")
    parser.add_argument("--status", help="planned, running, succeeded, failed or declined")
    parser.add_argument("--trigger", help="resize, preempt, signal, failure, dashboard, demo, requeue or policy")
    parser.add_argument("--limit", default="50", help="rows to show (1..1000, default 50)")
    parser.add_argument("--offset", default="0", help="rows to skip (default 0)")
    parser.add_argument("--rank-maps", action="store_true",
                        help="with --job: where every rank ran in each epoch (het-job component, node, GPU, "
                             "pp/dp/tp) instead of the migrations")
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print a JSON array, one object per migration (see below)")
    fmt.add_argument("--csv", action="store_true", help="print CSV with a header row")


def _table(rows: list[dict[str, Any]]) -> str:
    from db.vocab import PHASES

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    header = ["ID", "JOB", "TRIGGER", "STATUS", "FROM -> TO", "STARTED (UTC)", "AT STEP", "SECONDS", "PAUSE",
              "PHASES (" + "/".join(p.replace("build_", "") for p in PHASES) + ")", "MOVED", "CHECKPOINT", "VERIFIED"]
    body = [[str(r["id"]), r["job_name"], r["trigger"] + (" (restart)" if r.get("kind") == "restart" else ""),
             r["status"], f"{r['from_layout']} -> {r['to_layout']}",
             r["started_at"][:19].replace("T", " "), _step(r), sec(r["duration_s"]), sec(r["pause_s"]),
             "/".join(sec(r[f"{p}_s"]) for p in PHASES),
             human_bytes(r["bytes_moved"]), human_bytes(r["bytes_checkpoint"]),
             {True: "bit-exact", False: "MISMATCH", None: "-"}[r["bit_exact"]]] for r in rows]
    return format_table(header, body, [_below(r) for r in rows])


def _step(row: dict[str, Any]) -> str:
    """The step boundary the migration applied at (a restore: the checkpoint's step, and the steps lost)."""
    if row["at_step"] is None:
        return "-"
    return str(row["at_step"]) + (f" ({row['steps_lost']} lost)" if row["steps_lost"] else "")


def format_table(header: list[str], body: list[list[str]], below: list[list[str]] | None = None) -> str:
    """Columns padded to their widest cell; `below[i]`: lines printed under body row i, indented (a
    migration's notes, why a job failed), so they never widen the columns."""
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    out = []
    for i, line in enumerate([header, *body]):
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        if i and below:
            out += [f"    {text}" for text in below[i - 1]]
    return "\n".join(out)


def _below(row: dict[str, Any]) -> list[str]:
    """The lines printed under a migration's row: why it failed or was declined, then its notes."""
    lines = []
    if row["error"]:
        label = "declined" if row["status"] == "declined" else "error"
        lines.append(row["error"] if row["error"].startswith(label + ":") else f"{label}: {row['error']}")
    return lines + [f"note: {n}" for n in row.get("notes") or ()]


def _rank_map_table(rows: list[dict[str, Any]]) -> str:
    """One block per epoch: its layout and time, then each rank's place (component shown for het jobs)."""
    het = any(r["component"] for r in rows)
    out: list[str] = []
    for r in rows:
        if r["virtual_rank"] == 0 or not out:
            ended = (r["ended_at"] or "now")[:19].replace("T", " ")
            out += [f"epoch {r['epoch']}  {r['layout']}  {r['started_at'][:19].replace('T', ' ')} -> {ended}"]
        where = (f"component {r['component']}  " if het else "") + f"{r['node']} GPU {r['gpu']}"
        out.append(f"  rank {r['virtual_rank']:<4} {where}  pp{r['pp']} dp{r['dp']} tp{r['tp']}")
    return "\n".join(out)


def _rank_maps(args: argparse.Namespace) -> int:
    """`elastic history --rank-maps --job J`: the job's rank maps, every epoch, as a table, JSON or CSV."""
    from db.exports import RANK_MAP_COLUMNS, rank_map_rows
    from launcher.errors import UsageError

    if not args.job:
        raise UsageError("--rank-maps needs --job (a job id or name)")
    store = open_store(args.db, readonly=True)
    try:
        job = store.find_job(args.job)
        if job is None:
            raise UsageError(f"no job {args.job!r} in the database")
        rows = rank_map_rows(store.rank_maps(job.id))
    finally:
        store.close()
    return _print(args, rows, RANK_MAP_COLUMNS, _rank_map_table, f"job {job.name} has no rank map yet")


def run(args: argparse.Namespace) -> int:
    from db.filters import MAX_LIMIT, parse_history_filters, parse_int
    from db.store import HISTORY_COLUMNS
    from launcher.errors import UsageError

    if args.rank_maps:
        return _rank_maps(args)
    try:
        filters = parse_history_filters(vars(args))
        limit = parse_int("--limit", args.limit, 1, MAX_LIMIT)
        offset = parse_int("--offset", args.offset, 0, 10**9)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    store = open_store(args.db, readonly=True)
    try:
        rows = store.history(**filters.as_kwargs(), limit=limit, offset=offset)
        if not rows and args.job and store.find_job(args.job) is None:  # a typo, not a job without migrations
            raise UsageError(f"no job {args.job!r} in the database; `elastic jobs` lists them")
    finally:
        store.close()
    return _print(args, rows, HISTORY_COLUMNS, _table, "no migrations match")


def _print(args: argparse.Namespace, rows: list[dict[str, Any]], columns, table, empty: str) -> int:
    """Rows as JSON (--json), CSV (--csv) or the table; `empty` on stderr when there are none."""
    import json

    from db.exports import write_csv

    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
    elif args.csv:
        write_csv(rows, columns, sys.stdout)
    elif rows:
        print(table(rows))
    else:
        print(empty, file=sys.stderr)
    return 0
