"""`elastic dashboard`: serve the web dashboard, or manage its users.

The secret key comes from $ELASTIC_SECRET_KEY or `secret_key` in a TOML --config FILE,
never from code or flags (flags end up in shell history and `ps`).
"""
from __future__ import annotations

import argparse
import getpass
import sys

from launcher.commands.history import add_db_argument

EPILOG = """\
users:
  elastic dashboard --db URL --add-user alice --role admin     (prompts for the password)
  echo "$PW" | elastic dashboard --db URL --add-user bob --password-stdin
  elastic dashboard --db URL --list-users
  Roles: admin (may preempt/shrink/grow/suspend/resume) and viewer (read-only).

config FILE (TOML; keys: secret_key, db, host, port):
  secret_key = "..."   # or set ELASTIC_SECRET_KEY, which wins over the file
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    add_db_argument(parser)
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", default=None, type=int, help="port to bind (default 8050)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with secret_key (and optionally db, host, port)")
    users = parser.add_argument_group("user management (does not start the server)")
    users.add_argument("--add-user", metavar="NAME", help="create a user, or reset its password with --replace")
    users.add_argument("--role", choices=("admin", "viewer"), default="viewer", help="role for --add-user")
    users.add_argument("--password-stdin", action="store_true", help="read the password from standard input")
    users.add_argument("--replace", action="store_true", help="with --add-user: overwrite an existing user")
    users.add_argument("--list-users", action="store_true", help="print users and roles")


def _password(from_stdin: bool) -> str:
    from launcher.cli import UsageError

    if from_stdin:
        pw = sys.stdin.readline().rstrip("\r\n")
    else:
        pw = getpass.getpass("password: ")
        if pw != getpass.getpass("again: "):
            raise UsageError("passwords differ; try again")
    if len(pw) < 8:
        raise UsageError("password too short: use at least 8 characters")
    return pw


def _manage_users(args: argparse.Namespace, url: str) -> int:
    from launcher.cli import UsageError
    from launcher.commands.history import open_store

    store = open_store(url, create=True)
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


def run(args: argparse.Namespace) -> int:
    from dashboard.config import ConfigError, load_config
    from db import DatabaseError
    from db.urls import default_url
    from launcher.cli import UsageError

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    url = args.db or config.get("DB_URL") or default_url()
    if args.add_user or args.list_users:
        return _manage_users(args, url)
    from dashboard import create_app

    config["DB_URL"] = url
    try:
        app = create_app(config)
    except (ConfigError, DatabaseError) as exc:
        raise UsageError(str(exc)) from None
    host = args.host or config.get("HOST") or "127.0.0.1"
    port = args.port or int(config.get("PORT") or 8050)
    print(f"elastic dashboard on http://{host}:{port}/ (database {url})", file=sys.stderr)
    app.run(host=host, port=port, threaded=True, debug=False, use_reloader=False)
    return 0
