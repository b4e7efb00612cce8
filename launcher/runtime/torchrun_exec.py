"""`python -m launcher.runtime.torchrun_exec -- PROGRAM ARGS...`: give one worker its torchrun ranks, then exec PROGRAM.

elastic-launch starts a node's workers with per-node variables (GROUP_RANK, LOCAL_WORLD_SIZE,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*); on Slurm one `srun` step runs all tasks of
a node with the same environment, so the per-process ones are derived here from the task's local
index ($ELASTIC_LOCAL_ID, else $SLURM_LOCALID):

    LOCAL_RANK = local index        RANK = ROLE_RANK = $ELASTIC_RANK_BASE + LOCAL_RANK
    TORCHELASTIC_ERROR_FILE = $ELASTIC_ERROR_DIR/rank-<RANK>/error.json


($ELASTIC_RANK_BASE: the rank of the node's first worker, which nodes of different sizes need; without
it GROUP_RANK * LOCAL_WORLD_SIZE, nodes alike), then the process is replaced by PROGRAM (same pid, so
the launcher's SIGTERM reaches it).

Under Slurm the worker also gets srun's contract for the whole world, as `srun --ntasks=WORLD python
train.py` would set it: SLURM_PROCID = RANK, SLURM_LOCALID = LOCAL_RANK, SLURM_GTIDS, and the world's
SLURM_NTASKS, SLURM_NNODES, SLURM_NODEID, node lists and tasks per node, which the launcher carries
past srun as $ELASTIC_SRUN_* (srun sets its own step's -- one node's -- in every task). A program that cannot be started is reported in one line (exit
127), not a traceback; one that crashes in C code prints its Python stacks (PYTHONFAULTHANDLER, unless set).
"""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, MutableMapping, Sequence

from launcher.wire.env import ENV_ERROR_DIR, ENV_LOCAL_ID, ENV_RANK_BASE, ENV_SRUN_PREFIX


def rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """The per-process torchrun variables of the worker whose node-level environment is `env`."""
    local = int(env.get(ENV_LOCAL_ID, env.get("SLURM_LOCALID", "0")))
    if "GROUP_RANK" not in env:
        return {"LOCAL_RANK": str(local)}
    base = env.get(ENV_RANK_BASE)
    rank = (int(base) if base is not None else int(env["GROUP_RANK"]) * int(env.get("LOCAL_WORLD_SIZE", "1"))) + local
    out = {"LOCAL_RANK": str(local), "RANK": str(rank), "ROLE_RANK": str(rank)}
    if env.get(ENV_ERROR_DIR):  # torch.distributed.elastic's @record writes a failing rank's traceback there
        out["TORCHELASTIC_ERROR_FILE"] = os.path.join(env[ENV_ERROR_DIR], f"rank-{rank}", "error.json")
    if "SLURM_JOB_ID" in env:
        out.update(srun_env(env, rank, local))
    return out


def srun_env(env: Mapping[str, str], rank: int, local: int) -> dict[str, str]:
    """The world's SLURM_* variables of this task (see the module's docstring)."""
    carried = {k[len(ENV_SRUN_PREFIX):]: v for k, v in env.items() if k.startswith(ENV_SRUN_PREFIX)}
    if not carried:
        return {}
    first = rank - local
    return {**carried, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local),
            "SLURM_GTIDS": ",".join(str(first + i) for i in range(int(env.get("LOCAL_WORLD_SIZE", "1"))))}


def program(argv: Sequence[str]) -> list[str]:
    """`python ...` runs with this interpreter (the launcher's environment)."""
    argv = list(argv)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def missing_program(argv: Sequence[str]) -> str | None:
    """A one-line reason why `argv` cannot start (program or script or module not found), else None.
    Checked by elastic-launch before anything starts."""
    cmd = program(argv)
    if not cmd:
        return "no program given"
    if shutil.which(cmd[0]) is None:
        return f"program not found: {cmd[0]}"
    if os.path.basename(cmd[0]).startswith("python") and len(cmd) > 1:
        first = cmd[1]
        if first == "-m" and len(cmd) > 2:
            import importlib.util

            try:
                found = importlib.util.find_spec(cmd[2]) is not None
            except (ImportError, ValueError):
                found = False
            return None if found else f"python module not found: {cmd[2]}"
        if not first.startswith("-") and not os.path.exists(first):
            return f"script not found: {first}"
    return None


def main(argv: Sequence[str] | None = None, env: MutableMapping[str, str] = os.environ) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("launcher.runtime.torchrun_exec: give the program to run after --", file=sys.stderr)
        return 2
    env.update(rank_env(env))
    # a worker that aborts in C code (a gloo thread in the interpreter's teardown, the rare exit -6 after a
    # job's last step) prints every thread's Python stack to its log, as torchrun's @record would; a user's
    # own PYTHONFAULTHANDLER (even empty: off) is left as it is
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if "SLURM_PROCID" in env and f"{ENV_SRUN_PREFIX}SLURM_NODEID" in env and \
            f"{ENV_SRUN_PREFIX}SLURM_NTASKS_PER_NODE" not in env:
        env.pop("SLURM_NTASKS_PER_NODE", None)  # the node's step's: a world of uneven nodes has none
    if env.get("TORCHELASTIC_ERROR_FILE"):
        os.makedirs(os.path.dirname(env["TORCHELASTIC_ERROR_FILE"]), exist_ok=True)
    cmd = program(args)
    if shutil.which(cmd[0]) is None:
        print(f"elastic-launch worker: program not found: {cmd[0]}", file=sys.stderr)
        return 127
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        print(f"elastic-launch worker: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
