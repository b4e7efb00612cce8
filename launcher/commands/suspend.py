"""`elastic suspend JOB`: ask a running job to write its state once and give every device back.

Like resize, this only queues an admin request (plus an audit row); the launcher carries it out at
the next step boundary and records the job as suspended with its checkpoint (see elastic-launch).
"""
from __future__ import annotations

import argparse

from launcher.commands.follow import add_wait_arguments
from launcher.commands.history import add_db_argument
from launcher.commands.resize import request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id or name")
    add_db_argument(parser)
    add_wait_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return request(args, "suspend", {})
