"""`elastic`: one entry point, subcommands loaded lazily so `elastic plan` never imports torch."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module under launcher.commands, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("plan", "print the migration plan between two parallel layouts"),
    "bench-plan": ("bench_plan", "time the planner from 8 to 16,384 devices"),
    "bench-control": ("bench_control", "time live mode's per-step control plane at up to 4,096 ranks"),
    "bench-policy": ("bench_policy", "play a scripted stretch of plain jobs on the Slurm testbed, an elastic job "
                                     "on --policy manual then opportunistic: utilisation, waits, resizes"),
    "bench-rpc": ("bench_rpc", "count the requests one elastic job in steady training makes to slurmctld a minute "
                               "(sdiag), on --policy manual and opportunistic, on the Slurm testbed"),
    "bench": ("bench", "move real training state and compare with checkpoint restarts"),
    "demo": ("demo", "run a local elastic training demo (shrink and grow on this machine)"),
    "history": ("history", "query recorded migrations: phases, pause, bytes, and under each row why it failed "
                           "or was declined and its notes"),
    "jobs": ("jobs", "list jobs: state, mode (live/restart), layout, nodes, last step, why a failed job failed"),
    "resize": ("resize", "ask a running job to grow or shrink to N nodes"),
    "preempt": ("preempt", "ask a running job to give nodes back"),
    "suspend": ("suspend", "ask a running job to checkpoint once and give every device back"),
    "resume": ("resume", "ask for a suspended job to go on from its checkpoint (next elastic-launch)"),
    "testbed": ("testbed", "bring a real 4-node Slurm cluster (22.05, 24.11 or 26.05) up or down on loopback"),
    "serve": ("dashboard", "serve the cluster's shared service: the API the CLI and launchers call (identity by "
                           "munge) and the web dashboard, in one process that alone holds the database"),
    "dashboard": ("dashboard", "serve the web dashboard (the same server as `elastic serve`)"),
    "db": ("db_admin", "upgrade the database schema explicitly (`elastic db upgrade`) or show its version"),
}


from launcher.errors import UsageError
from service.errors import ServiceError

__all__ = ["UsageError", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic",
        description="Elastic hybrid-parallel training: plan, run and watch model-state migrations.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(f"launcher.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"launcher.commands.{module_name}":
                raise
            sp.set_defaults(_run=_not_built(name))
            continue
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


def _not_built(name: str):
    def run(_args: argparse.Namespace) -> int:
        print(f"elastic {name}: not built yet in this version", file=sys.stderr)
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except UsageError as exc:
        print(f"elastic {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ServiceError as exc:  # the shared service refused (not your job) or could not be reached
        print(f"elastic {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`elastic history --csv | head -1`): stop quietly, like other Unix tools.
        # Point stdout at /dev/null so the interpreter's final flush cannot raise a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a killed writer


if __name__ == "__main__":
    sys.exit(main())
