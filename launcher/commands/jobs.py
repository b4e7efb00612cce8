"""`elastic jobs`: the jobs the database knows, one line each (or JSON).

A running job whose launcher stopped heartbeating (killed, its node gone) is shown as `lost`, with the
command that takes it over (db.liveness). A job is listed from the moment `elastic-launch` starts it, in either mode: `live` (its program uses
the runtime API, state moves between running workers) or `restart` (torchrun's contract: every
worker is restarted on the new node set and resumes from the script's own checkpoint).
"""
from __future__ import annotations

import argparse
import json
import sys

from launcher.commands.history import add_db_argument, format_table, open_store

COLUMNS = ("id", "name", "slurm_job_id", "state", "mode", "layout", "nodes", "last_step", "survives", "why",
           "lost_since")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from db.vocab import JOB_STATES

    add_db_argument(parser)
    parser.add_argument("--state", choices=JOB_STATES, help="only jobs in this state")
    parser.add_argument("--json", action="store_true", help="print a JSON array")


def rows(store, state: str | None = None) -> list[dict]:
    """One flat dict per job (COLUMNS); nodes: the nodes the job holds and runs on now; survives: what its
    layout and allocation survive as the launcher last said (db.survival; None when not recorded); why: why
    a failed job failed, as the launcher said (else None)."""
    from db.liveness import lost_since, resume_hint, shown_state
    from db.survival import survival_of

    out = []
    for job in store.list_jobs(state):
        lost = lost_since(job)
        nodes = [n.name for n in store.list_nodes(job.id) if n.state == "active"]
        out.append({"id": job.id, "name": job.name, "slurm_job_id": job.slurm_job_id, "state": shown_state(job),
                    "mode": job.mode, "layout": job.layout, "nodes": nodes, "last_step": job.last_step,
                    "survives": survival_of(store.launch_spec(job.id)),
                    "why": store.why_failed(job.id) if job.state == "failed" else resume_hint(job) if lost else None,
                    "lost_since": lost.isoformat() if lost else None})
    return out


def _table(items: list[dict]) -> str:
    from db.survival import survival_words

    header = ["ID", "NAME", "SLURM", "STATE", "MODE", "LAYOUT", "NODES", "STEP", "SURVIVES"]
    body = [[str(r["id"]), r["name"], r["slurm_job_id"] or "-", r["state"], r["mode"], r["layout"],
             ",".join(r["nodes"]) or "-", "-" if r["last_step"] is None else str(r["last_step"]),
             survival_words(r["survives"])] for r in items]
    return format_table(header, body, [_below(r) for r in items])


def _below(r: dict) -> list[str]:
    """Why a failed job failed; since when a lost one has no launcher, and how to take it over."""
    if r["lost_since"]:
        return [f"lost: no heartbeat from its launcher since {r['lost_since'][:19].replace('T', ' ')} UTC; {r['why']}"]
    return [f"failed: {r['why']}"] if r["why"] else []


def run(args: argparse.Namespace) -> int:
    store = open_store(args.db, readonly=True)
    try:
        items = rows(store, args.state)
    finally:
        store.close()
    if args.json:
        json.dump(items, sys.stdout, indent=2)
        print()
    elif items:
        print(_table(items))
    else:
        print("no jobs" + (f" in state {args.state}" if args.state else ""), file=sys.stderr)
    return 0
