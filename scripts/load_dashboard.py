#!/usr/bin/env python3
"""Load check of `elastic dashboard` (issue 12): a cluster-sized database, a real server, loopback only.

Seeds a fresh database (SQLite in a temp dir; --postgres: a database on a throwaway PostgreSQL server
started from Debian's binaries as the tests start it, tests/db/backends.py) with --jobs jobs (--running of them running, each with a rank map on
two 4-GPU nodes shared with other jobs) and --migrations migrations, starts `elastic dashboard` on
127.0.0.1 (its default server: waitress), and measures:

  * median latency of GET /, GET /jobs/<id> (a running job) and GET /history, --samples sequential
    requests each;
  * --burst concurrent requests (half /, half /history) -> how many were not HTTP 200;
  * server RSS (VmRSS) idle vs. its peak during --bad-logins concurrent wrong-password logins.

Everything is bounded: every request has a timeout, the server is killed at the end, the database
lives in a temporary directory. Run it under the heavy lock, e.g.
  flock /tmp/elastic-heavy.lock timeout 600 .venv/bin/python scripts/load_dashboard.py
Figures print as one JSON object (and a readable summary on stderr); nothing here is a pass/fail test.
"""
from __future__ import annotations

import argparse
import http.cookiejar
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HOST = "127.0.0.1"  # loopback only, by construction
PASSWORD = "load-test-password"


def seed(url: str, jobs: int, running: int, migrations: int) -> int:
    """Jobs and rank maps through the Store; migrations in bulk (10,000 Store calls would take ~40 s).
    Returns the id of a running job to fetch."""
    from db import Store
    from db.records import RankEntry

    store = Store(url)
    store.add_user("load", PASSWORD, "admin")
    ids = []
    for i in range(jobs):
        state = "running" if i < running else ("finished" if i % 2 else "failed")
        nodes = [f"n{(2 * i) % 400:03d}", f"n{(2 * i + 1) % 400:03d}"]
        jid = store.create_job(f"job-{i:04d}", "pp2tp2dp2", 4, 8, nodes=nodes, sla_tier="standard")
        store.record_rank_map(jid, 0, "pp2tp2dp2", [
            RankEntry(r, nodes[r // 4], r % 4, r // 4, (r // 2) % 2, r % 2) for r in range(8)])
        if state != "running":
            store.set_job_state(jid, state)
        ids.append(jid)
    # Bulk ORM insert (defaults of newer columns apply): a seeding shortcut past the Store's API.
    from datetime import datetime

    from sqlalchemy import insert

    from db.models import MigrationRow

    t0, t1 = datetime(2026, 1, 1), datetime(2026, 1, 1, 0, 0, 5)
    with store._tx() as s:
        s.execute(insert(MigrationRow), [
            {"job_id": ids[k % len(ids)], "from_layout": "pp2tp2dp2", "to_layout": "pp2tp2dp1", "trigger": "resize",
             "status": "succeeded", "started_at": t0, "finished_at": t1, "bytes_moved": 1_000_000,
             "bytes_checkpoint": 8_000_000, "bit_exact": True, "plan_summary": {}, "fragmentation_before": {}}
            for k in range(migrations)])
    store.close()
    return ids[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Client:
    """A cookie-keeping HTTP client for one server (no redirects followed on POST /login)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def get(self, path: str) -> tuple[int, str]:
        try:
            with self.opener.open(self.base + path, timeout=60) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def login(self, user: str, password: str) -> int:
        _, page = self.get("/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
        data = urllib.parse.urlencode({"username": user, "password": password, "csrf_token": token}).encode()
        try:
            with self.opener.open(self.base + "/login", data=data, timeout=60) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code


def timed_median(client: Client, path: str, samples: int) -> float:
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        status, _ = client.get(path)
        times.append(time.perf_counter() - t)
        if status != 200:
            raise RuntimeError(f"GET {path} answered {status}")
    return statistics.median(times) * 1000


def burst(base: str, cookie_client: Client, paths: list[str]) -> dict[str, int]:
    """All requests released at once from their own threads; counts of each outcome."""
    start = threading.Barrier(len(paths))
    outcome: dict[str, int] = {}
    lock = threading.Lock()

    def one(path: str) -> None:
        c = Client(base)
        c.jar = cookie_client.jar
        c.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(c.jar))
        start.wait()
        try:
            status, _ = c.get(path)
            key = str(status)
        except Exception as exc:  # connection refused/reset: an error like a 500
            key = type(exc).__name__
        with lock:
            outcome[key] = outcome.get(key, 0) + 1

    threads = [threading.Thread(target=one, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return outcome


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--running", type=int, default=300)
    p.add_argument("--migrations", type=int, default=10_000)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--burst", type=int, default=200)
    p.add_argument("--bad-logins", type=int, default=50)
    p.add_argument("--threads", type=int, default=8, help="server threads (elastic dashboard --threads)")
    p.add_argument("--postgres", action="store_true", help="seed and serve a PostgreSQL database instead of SQLite")
    args = p.parse_args()
    if not (0 < args.running <= args.jobs <= 20_000 and args.migrations <= 200_000 and args.burst <= 1000
            and args.bad_logins <= 1000 and args.samples <= 1000):
        p.error("bounds: running <= jobs <= 20000, migrations <= 200000, burst and bad-logins <= 1000")
    tmp = Path(tempfile.mkdtemp(prefix="elastic-load-"))
    pg = None
    if args.postgres:
        from tests.db.backends import PgServer, find_bindir

        bindir = find_bindir()
        if bindir is None:
            p.error("--postgres: no /usr/lib/postgresql/*/bin/initdb; run scripts/install-postgres.sh")
        pg = PgServer(bindir).start()
    try:
        return measure(args, pg.create_database() if pg else f"sqlite:///{tmp / 'load.db'}")
    finally:
        if pg is not None:
            pg.stop()


def measure(args: argparse.Namespace, db: str) -> int:
    """Seed `db`, serve it, measure; prints the figures."""
    t = time.time()
    job_id = seed(db, args.jobs, args.running, args.migrations)
    seeded_s = time.time() - t
    port = free_port()
    env = {**os.environ, "ELASTIC_SECRET_KEY": "load-test-secret-0123456789abcdef", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "launcher.cli", "dashboard", "--db", str(db), "--host", HOST,
                               "--port", str(port), "--threads", str(args.threads)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://{HOST}:{port}"
    try:
        for _ in range(200):
            try:
                socket.create_connection((HOST, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        client = Client(base)
        assert client.login("load", PASSWORD) in (200, 302)
        for path in ("/", f"/jobs/{job_id}", "/history"):  # warm up every page once
            client.get(path)
        idle = rss_kib(server.pid)
        figures: dict[str, Any] = {
            "backend": db.split(":", 1)[0], "jobs": args.jobs, "running": args.running, "migrations": args.migrations, "threads": args.threads,
            "seed_s": round(seeded_s, 1),
            "get_jobs_median_ms": round(timed_median(client, "/", args.samples), 1),
            "get_job_median_ms": round(timed_median(client, f"/jobs/{job_id}", args.samples), 1),
            "get_history_median_ms": round(timed_median(client, "/history", args.samples), 1),
            "jobs_page_kb": round(len(client.get("/")[1].encode()) / 1024, 1),
        }
        outcome = burst(base, client, ["/", "/history"] * (args.burst // 2))
        figures["burst"] = outcome
        figures["burst_errors"] = sum(v for k, v in outcome.items() if k != "200")

        peak = [idle]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_kib(server.pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        statuses: dict[str, int] = {}
        lock = threading.Lock()
        gate = threading.Barrier(args.bad_logins)

        def bad(i: int) -> None:
            c = Client(base)
            gate.wait()
            code = str(c.login(f"load{i % 5}" if i % 2 else "load", "wrong-password"))
            with lock:
                statuses[code] = statuses.get(code, 0) + 1

        workers = [threading.Thread(target=bad, args=(i,)) for i in range(args.bad_logins)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        time.sleep(0.2)
        done.set()
        sampler.join()
        figures.update(idle_rss_mib=round(idle / 1024, 1), bad_login_peak_rss_mib=round(peak[0] / 1024, 1),
                       rss_ratio=round(peak[0] / idle, 2), bad_login_statuses=statuses)
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
    print(json.dumps(figures))
    print(f"GET / median {figures['get_jobs_median_ms']} ms ({figures['jobs_page_kb']} KiB), "
          f"GET /jobs/{job_id} median {figures['get_job_median_ms']} ms, GET /history median "
          f"{figures['get_history_median_ms']} ms; {args.burst} concurrent -> "
          f"{figures['burst_errors']} errors {outcome}; RSS idle {figures['idle_rss_mib']} MiB, peak during "
          f"{args.bad_logins} bad logins {figures['bad_login_peak_rss_mib']} MiB (x{figures['rss_ratio']}) "
          f"{statuses}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
