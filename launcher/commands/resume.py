"""`elastic resume JOB`: ask for a suspended job to go on from its checkpoint.

It queues a `resume` request; the next `elastic-launch` of that job name (e.g. the resubmitted
batch script) finds it, loads the job's checkpoint on whatever layout fits the devices it has,
and answers the request. `elastic-launch --resume` does the same without a request.
"""
from __future__ import annotations

import argparse

from launcher.commands.resize import request
from launcher.commands.suspend import add_arguments

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    return request(args, "resume", {})
