"""`elastic serve` (or `elastic dashboard`): serve the shared service and its web dashboard, or manage its users.

One process holds the database; users, sbatch scripts and launchers get its address (`--db http://host:8050`)
and prove who they are with munge (service.api), never with database credentials.

The secret key comes from $ELASTIC_SECRET_KEY or `secret_key` in a TOML --config FILE,
never from code or flags (flags end up in shell history and `ps`).
"""
from __future__ import annotations

import argparse
import getpass
import sys
from typing import Callable

from launcher.commands.history import add_db_argument

EPILOG = """\
users:
  elastic dashboard --db URL --add-user alice --role admin     (prompts for the password)
  echo "$PW" | elastic dashboard --db URL --add-user bob --password-stdin
  elastic dashboard --db URL --list-users
  Roles: admin (may preempt/shrink/grow/suspend/resume) and viewer (read-only).

the shared service (several users on one cluster):
  elastic serve --db postgresql://elastic@dbhost/elastic --host 0.0.0.0 --operators-group hpc-ops
  then every user and sbatch script: export ELASTIC_DB_URL=http://SERVICE-HOST:8050
  Each call carries the caller's munge credential (munged runs on every Slurm node): a user may see and
  resize/suspend/resume their own jobs; operators (members of --operators-group, Slurm's Operators and
  Administrators in sacctmgr's AdminLevel where it answers, and root) act on every job and preempt;
  --private-jobs hides other users' jobs (like Slurm's PrivateData=jobs). Only this process opens the database.

config FILE (TOML; keys: secret_key, db, host, port, threads, secure_cookies, session_lifetime,
             operators_group, private_jobs, munge_socket):
  secret_key = "..."   # or set ELASTIC_SECRET_KEY, which wins over the file
  secure_cookies = true   # behind HTTPS: the session cookie is never sent in clear
  session_lifetime = 28800   # seconds a login lasts (default 8 h)

server: waitress (a production WSGI server, --threads worker threads) by default;
  --server dev runs Werkzeug's development server (debugging only).
"""


def port_number(text: str) -> int:
    """argparse type for --port: 1..65535 (0 or 99999 would silently bind another port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port {text!r}: expected a whole number 1..65535") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"bad port {value}: expected 1..65535")
    return value


def bounded_int(lo: int, hi: int) -> Callable[[str], int]:
    """argparse type: a whole number in lo..hi, with a one-line error otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad number {text!r}: expected {lo}..{hi}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"bad number {value}: expected {lo}..{hi}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    add_db_argument(parser)
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", default=None, type=port_number, help="port to bind, 1..65535 (default 8050)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with secret_key (and optionally db, host, port, ...)")
    parser.add_argument("--server", choices=("waitress", "dev"), default="waitress",
                        help="WSGI server (default waitress; dev = Werkzeug's, for debugging only)")
    parser.add_argument("--threads", type=bounded_int(1, 256), default=None,
                        help="server threads, and database connections to match (default 8)")
    parser.add_argument("--secure-cookies", action="store_true", default=None,
                        help="mark the session cookie Secure (serve behind HTTPS)")
    parser.add_argument("--session-lifetime", type=bounded_int(60, 90 * 86400), default=None, metavar="SECONDS",
                        help="how long a login lasts (default 28800 = 8 h)")
    shared = parser.add_argument_group("the shared service's API (who may do what)")
    shared.add_argument("--operators-group", metavar="GROUP", default=None,
                        help="Unix group whose members may act on every job and preempt (root, and Slurm's "
                             "Operators/Administrators in sacctmgr, always may)")
    shared.add_argument("--private-jobs", action="store_true", default=None,
                        help="users see only their own jobs (like Slurm's PrivateData=jobs)")
    shared.add_argument("--munge-socket", metavar="PATH", default=None,
                        help="munged's socket to verify credentials with (default munge's own)")
    shared.add_argument("--login", choices=("pam", "proxy", "local"), default=None,
                        help="how people log in to the dashboard: pam (the cluster's own accounts; the default of "
                             "`elastic serve`), proxy (a reverse proxy's authenticated user, in the X-Remote-User "
                             "header, believed from --proxy-address only) or local (passwords made with --add-user; "
                             "the default of `elastic dashboard`, for one user's own host)")
    shared.add_argument("--proxy-address", action="append", metavar="ADDR", dest="proxy_addresses", default=None,
                        help="with --login proxy: the proxy's address (repeat for several)")
    users = parser.add_argument_group("user management (does not start the server)")
    users.add_argument("--add-user", metavar="NAME", help="create a user, or reset its password with --replace")
    users.add_argument("--role", choices=("admin", "viewer"), default="viewer", help="role for --add-user")
    users.add_argument("--password-stdin", action="store_true", help="read the password from standard input")
    users.add_argument("--replace", action="store_true", help="with --add-user: overwrite an existing user")
    users.add_argument("--list-users", action="store_true", help="print users and roles")


def _password(from_stdin: bool) -> str:
    from launcher.errors import UsageError

    if from_stdin:
        pw = sys.stdin.readline().rstrip("\r\n")
    else:
        try:
            pw = getpass.getpass("password: ")
            again = getpass.getpass("again: ")
        except EOFError:
            raise UsageError("no password given (standard input ended); without a terminal use "
                             "--password-stdin, e.g. echo \"$PW\" | elastic dashboard --add-user NAME --password-stdin") from None
        if pw != again:
            raise UsageError("passwords differ; try again")
    if len(pw) < 8:
        raise UsageError("password too short: use at least 8 characters")
    return pw


def _manage_users(args: argparse.Namespace, url: str) -> int:
    from launcher.errors import UsageError
    from launcher.commands.history import open_store
    from service.client import is_service_url

    if is_service_url(url):
        raise UsageError(f"{url} is the shared service, whose users log in with their cluster accounts; dashboard "
                         "users are kept in the database itself: run this where `elastic serve` runs, with its "
                         "--db or --config")
    store = open_store(url, create=True)  # the first user may come before the first job
    try:
        if args.add_user:
            try:
                store.add_user(args.add_user, _password(args.password_stdin), args.role, replace=args.replace)
            except ValueError as exc:
                raise UsageError(f"{exc} (use --replace to reset it)") from None
            store.audit("cli", "add-user", f"user:{args.add_user}", f"ok: role {args.role}")
            print(f"user {args.add_user} ({args.role}) saved in {store.display_url}", file=sys.stderr)
        for user in store.list_users() if args.list_users else ():
            print(f"{user.name}\t{user.role}")
        return 0
    finally:
        store.close()


def first_run_admin(store) -> None:
    """With local logins and no user yet, as the demo does: an `admin` with a one-off password printed here
    (this console only; it goes nowhere else), so the first run needs no second command."""
    import secrets

    if store.list_users():
        return
    password = secrets.token_urlsafe(12)
    store.add_user("admin", password, "admin")
    store.audit("cli", "add-user", "user:admin", "ok: role admin, the first run's one-off password")
    print(f"no dashboard user yet: log in as admin / {password} (a one-off password, shown once; set your own "
          f"with `elastic dashboard --add-user admin --role admin --replace`)", file=sys.stderr)


def slurm_job_uid(slurm_job_id: str) -> int | None:
    """The uid Slurm runs job `slurm_job_id` as, which a launcher's credential must match when it registers the
    job (service.api); None where no Slurm answers here (the service then trusts the credential alone)."""
    import shutil

    from launcher.backends.slurm.client import SlurmCommands, SlurmError

    if shutil.which("scontrol") is None or not slurm_job_id.isdigit():
        return None
    try:
        return SlurmCommands().job_info(int(slurm_job_id)).user_id
    except (SlurmError, ValueError):
        return None


class SlurmAdminLevel:
    """Whether Slurm's accounting names a user Operator or Administrator (`sacctmgr show user`), as Slurm's own
    commands honour it; asked at most once a minute per user. False where sacctmgr does not answer (no slurmdbd):
    then the operators group alone decides."""

    TTL_S = 60.0

    def __init__(self) -> None:
        self.known: dict[str, tuple[float, bool]] = {}

    def __call__(self, user: str) -> bool:
        import time

        from launcher.backends.slurm.client import SlurmCommands, SlurmError

        now = time.monotonic()
        if user not in self.known or now - self.known[user][0] >= self.TTL_S:
            try:
                level = SlurmCommands(timeout=10).admin_level(user)  # a login waits on it: not long
            except SlurmError:
                level = ""
            self.known[user] = (now, level in ("Operator", "Administrator"))
        return self.known[user][1]


def run(args: argparse.Namespace) -> int:
    from dashboard.config import ConfigError, load_config
    from db import DatabaseError
    from db.urls import default_url
    from launcher.errors import UsageError

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    url = args.db or config.get("DB_URL") or default_url()
    if args.add_user or args.list_users:
        return _manage_users(args, url)
    from dashboard import create_app

    config["DB_URL"] = url
    for key, value in (("THREADS", args.threads), ("SECURE_COOKIES", args.secure_cookies),
                       ("SESSION_LIFETIME_S", args.session_lifetime), ("OPERATORS_GROUP", args.operators_group),
                       ("PRIVATE_JOBS", args.private_jobs), ("MUNGE_SOCKET", args.munge_socket),
                       ("LOGIN", args.login), ("PROXY_ADDRESSES", args.proxy_addresses)):
        if value is not None:
            config[key] = value
    config["SLURM_JOB_UID"] = slurm_job_uid
    config["SLURM_OPERATOR"] = SlurmAdminLevel()
    config.setdefault("LOGIN", "pam" if args.command == "serve" else "local")
    if config["LOGIN"] not in ("pam", "proxy", "local"):
        raise UsageError(f"login {config['LOGIN']!r}: expected pam, proxy or local")
    if config["LOGIN"] == "proxy" and not config.get("PROXY_ADDRESSES"):
        raise UsageError("--login proxy believes the user header only from the proxy: name its address with "
                         "--proxy-address ADDR (or proxy_addresses in --config)")
    try:
        app = create_app(config)
    except (ConfigError, DatabaseError) as exc:
        raise UsageError(str(exc)) from None
    host = args.host or config.get("HOST") or "127.0.0.1"
    port = args.port or int(config.get("PORT") or 8050)
    threads = int(config.get("THREADS") or 8)
    print(f"elastic {args.command} on http://{host}:{port}/ (database {url}, {args.server} server, "
          f"{threads} threads; API at /api/v1 for `--db http://{host}:{port}`)", file=sys.stderr)
    if config["LOGIN"] == "local":
        first_run_admin(app.extensions["elastic_store"])
    try:
        if args.server == "dev":
            app.run(host=host, port=port, threaded=True, debug=False, use_reloader=False)
        else:
            from waitress import serve

            serve(app, host=host, port=port, threads=threads, ident="elastic")
    except OSError as exc:
        raise UsageError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    return 0
