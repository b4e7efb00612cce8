"""elastic-launch's command line: the flags, and the checked `Options` a job runs with.

Every check that can fail on the user's input happens here, before anything starts: a bad flag is
a UsageError (one line on stderr, exit code 2).
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from db.vocab import POLICIES
from launcher.errors import UsageError
from launcher.policy.survival import DEFAULT_CHECKPOINT_EVERY, auto_checkpoint_every

SIGNAL_ACTIONS = ("shrink", "suspend", "ignore")
# migrate.allocator.PLACEMENTS, resilient first (the default); spelled out so --help does not import the planner
PLACEMENTS = ("resilient", "packed")
#: limits that keep a mistyped count from stalling the up-front checks (every node count's layout is
#: worked out before anything starts); no Slurm job or node comes near them
MAX_NODES = 16384
MAX_GPUS_PER_NODE = 1024


def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's `--nnodes`: N or MIN:MAX."""
    try:
        lo, sep, hi = text.partition(":")
        lo_n, hi_n = int(lo), int(hi if sep else lo)
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: write N or MIN:MAX, e.g. 2:4") from None
    if lo_n < 1 or hi_n < lo_n:
        raise UsageError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    if hi_n > MAX_NODES:
        raise UsageError(f"--nnodes {text!r}: at most {MAX_NODES} nodes")
    return lo_n, hi_n


def parse_layouts(text: str | None):
    from migrate.layout import LayoutError, ParallelConfig

    if not text:
        return []
    try:
        return [ParallelConfig.parse(t) for t in text.split(",") if t.strip()]
    except LayoutError as exc:
        raise UsageError(f"--layouts: {exc}") from None


def model_from_command(argv: Sequence[str]):
    """The ModelSpec when the command is the reference worker (so layouts are checked up front), else None."""
    if "launcher.worker" not in argv:
        return None
    from launcher.worker import build_parser
    from migrate.layout import LayoutError, ModelSpec

    rest = list(argv[list(argv).index("launcher.worker") + 1:])
    args, _unknown = build_parser().parse_known_args(rest)
    try:
        return ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)
    except LayoutError as exc:
        raise UsageError(f"worker model flags: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elastic-launch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run an elastic hybrid-parallel training job: start one worker per GPU with srun (or as local "
                    "processes), move the model state directly between workers when nodes are taken away or given "
                    "back, and record every rank map and migration in the database.",
        epilog="Any program runs in RESTART mode (torchrun's contract): every worker gets RANK, LOCAL_RANK, "
               "WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT (a rendezvous of its own world), "
               "TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_RUN_ID, and on Slurm srun's for the whole world "
               "(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES, node lists), as "
               "`srun --ntasks=N python train.py` would set them; on a resize, preemption, USR1 or worker "
               "failure all workers get SIGTERM (SIGKILL after --term-timeout) and the new world starts on the "
               "new nodes; the program resumes from its own checkpoint. A program that joins through the "
               "runtime API (launcher.runtime, or python -m launcher.worker) runs in LIVE mode: its state moves "
               "between the running workers at a step boundary.\n\n"
               "Triggers: `elastic resize JOB --nodes N`, `elastic preempt JOB --nodes n3,n4`, dashboard requests, "
               "SIGUSR1 (see --on-signal), a worker that dies.\n\n"
               "Example (in an sbatch script):\n"
               "  exec elastic-launch --nnodes 2:4 --gpus-per-node 4 --layouts pp4tp2,pp2tp4,pp2tp2 \\\n"
               "      --db sqlite:///${TMPDIR:-/tmp}/elastic-$SLURM_JOB_ID.db -- python -m launcher.worker --layers 24 --hidden 512",
    )
    _add_job_arguments(p)
    _add_state_arguments(p)
    _add_run_arguments(p)
    return p


def _add_job_arguments(p: argparse.ArgumentParser) -> None:
    """What the job runs on: nodes, GPUs, layouts, database, backend, control plane, signals."""
    p.add_argument("--nnodes", default="1", metavar="MIN:MAX",
                   help="nodes to run on, N or MIN:MAX (torchrun's spelling); the job never shrinks below MIN "
                        "(default 1)")
    p.add_argument("--gpus-per-node", default=None, metavar="G[,G...]",
                   help="GPUs (workers) per node (default: $SLURM_GPUS_ON_NODE, else 1); the local backend also "
                        "takes one count per simulated node, e.g. 4,4,2,2 (uneven nodes: TP then fits every node)")
    p.add_argument("--layouts", metavar="L1,L2,...",
                   help="allowed layouts in order of preference, e.g. pp4tp2,pp2tp4,pp2tp2; fsdpN shards the data-"
                        "parallel dimension N ways with FSDP2 (live mode: tp2fsdp4), hsdpRxS is R replicas of S "
                        "shards (tp2hsdp2x2); for each device count the valid one using most devices wins. Default: "
                        "any PP x TP x DP grid with TP inside a node, layers %% pp == 0 and heads %% tp == 0")
    p.add_argument("--db", metavar="URL", default=None,
                   help="SQLAlchemy URL or SQLite path where rank maps, migrations and requests live "
                        "(default $ELASTIC_DB_URL or sqlite:///var/elastic.db)")
    p.add_argument("--backend", choices=("auto", "slurm", "local"), default="auto",
                   help="slurm: the running allocation ($SLURM_JOB_ID), through pyslurm when a matching one imports, "
                        "else the Slurm commands; local: processes on this machine; auto (default): slurm inside "
                        "a Slurm job, else local")
    p.add_argument("--job-id", type=int, default=None,
                   help="Slurm job to run in (default $SLURM_JOB_ID)")
    p.add_argument("--local-nodes", type=int, default=None, metavar="N",
                   help="local backend: simulated nodes (default MAX of --nnodes)")
    p.add_argument("--fresh-processes", action="store_true",
                   help="local backend: start every worker as a new interpreter, as srun does (default: fork it "
                        "from one process that has imported torch already, when python would run it the same way)")
    p.add_argument("--job-name", default=None, help="name recorded in the database (default $SLURM_JOB_NAME or 'elastic')")
    p.add_argument("--master-addr", default=None,
                   help="address workers use to reach the control plane (default: this host's name; 127.0.0.1 "
                        "for the local backend)")
    p.add_argument("--master-port", type=int, default=0, help="control-plane port (default: a free port)")
    p.add_argument("--policy", choices=POLICIES, default="manual",
                   help="manual (default): the job changes size only when asked (elastic resize/preempt, the "
                        "dashboard, a signal); opportunistic (Slurm, live mode): it grows into its partition's idle "
                        "nodes up to MAX and gives nodes above MIN back when a job pending there needs them "
                        "(launcher/policy/opportunistic.py)")
    p.add_argument("--policy-idle", type=float, default=30.0, metavar="S",
                   help="opportunistic: seconds nodes must stay idle, with no job pending, before the job grows "
                        "onto them (default 30)")
    p.add_argument("--policy-dwell", type=float, default=60.0, metavar="S",
                   help="opportunistic: seconds after any resize before the next grow (default 60)")
    p.add_argument("--policy-max-per-hour", type=int, default=12, metavar="N",
                   help="opportunistic: at most this many policy resizes in any hour, yields included (default 12)")
    p.add_argument("--policy-watch", type=float, default=30.0, metavar="S",
                   help="seconds between two looks at the partition (sinfo, squeue: 3 requests to slurmctld): a "
                        "pending job waits up to this long before the job starts giving nodes back (default 30, "
                        "Slurm's own backfill interval; at least 0.5)")
    p.add_argument("--on-signal", choices=SIGNAL_ACTIONS, default="shrink",
                   help="what SIGUSR1 (Slurm's warning, #SBATCH --signal=B:USR1@60) does: shrink to MIN nodes, "
                        "suspend (stop the workers at a step boundary, mark the job suspended), or ignore "
                        "(default shrink)")


def _add_state_arguments(p: argparse.ArgumentParser) -> None:
    """How the training state is kept: checkpoints, release early, placement, resume."""
    p.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help="where the job's checkpoints go (suspend, --checkpoint-every) and --resume reads them; "
                        "every node must see it (default: checkpoints/<job name> next to a SQLite --db, else "
                        "./var/checkpoints/<job name>)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="write a safety checkpoint every N steps in the background (training pauses only for "
                        "the in-memory copy); a failure that no DP replica covers restarts from it. Default: every "
                        f"{DEFAULT_CHECKPOINT_EVERY} steps when a layout the job may run (any node count of --nnodes) "
                        "cannot survive the loss of a node, else never; 0: never")
    p.add_argument("--release-early", action="store_true",
                   help="migrations free each old tensor after its last send: lower peak memory, but a failure "
                        "half way then needs DP replicas or a checkpoint instead of the old layout")
    p.add_argument("--placement", choices=PLACEMENTS, default="resilient",
                   help="where the DP replicas of a stage start: resilient (default) puts them on different nodes, so "
                        "the loss of any one node leaves a full replica and the job re-plans from it instead of "
                        "restarting from a checkpoint; the price is that gradient all-reduces cross nodes. packed "
                        "keeps ranks in device order (replicas of a stage side by side, all-reduces inside a node). "
                        "With DP = 1 both are the same")
    p.add_argument("--resume", action="store_true",
                   help="resume the suspended job of --job-name from its checkpoint (the database's, else the "
                        "newest complete one in --checkpoint-dir) on whatever layout fits now, at the next step")


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Logs, timeouts, the mode, restarts, the dry run and the program."""
    p.add_argument("--log-dir", type=Path, default=None, help="write worker output under this folder (default: inherit)")
    p.add_argument("--poll", type=float, default=0.2, help="seconds between checks of workers and requests (default 0.2)")
    p.add_argument("--ready-timeout", type=float, default=180.0,
                   help="seconds new workers have to start and register (default 180)")
    p.add_argument("--migrate-timeout", type=float, default=300.0,
                   help="seconds a migration may take before it counts as failed (default 300)")
    p.add_argument("--companion-timeout", type=float, default=120.0,
                   help="Slurm: growing beyond the nodes the job holds submits a companion job (same partition, "
                        "GPUs and tasks per node) whose steps run the new workers; it has this many seconds to "
                        "start (and its workers to register) or it is cancelled and the grow fails (default 120)")
    p.add_argument("--mode", choices=("auto", "live", "restart"), default="auto",
                   help="live: the program uses the runtime API (launcher.runtime, or python -m launcher.worker) and "
                        "its state moves between running workers; restart: torchrun's contract, every worker is "
                        "stopped and the new world started, the program resumes from its own checkpoint; auto "
                        "(default): live once the workers join through the runtime API, restart until then")
    p.add_argument("--term-timeout", type=float, default=30.0, metavar="S",
                   help="restart mode: seconds workers have after SIGTERM before SIGKILL (default 30)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="worker failures the job restarts from before it fails (torchrun's meaning): restart mode's "
                        "restarts, and live mode's restores from a safety checkpoint (a failure no DP replica "
                        "covers; recovering from a replica does not count) (default 3). Counted per elastic-launch "
                        "run, as torchrun counts per agent run: a run started with --resume has all N again")
    p.add_argument("--dry-run", action="store_true",
                   help="print the srun and scontrol commands it would run and exit; starts and writes nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the worker program, e.g. `-- python -m launcher.worker --layers 24 --hidden 512`")


@dataclass
class Options:
    min_nodes: int
    max_nodes: int
    gpus_per_node: int
    layouts: list
    command: list[str]
    db_url: str | None = None
    on_signal: str = "shrink"
    job_name: str = "elastic"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    poll: float = 0.2
    ready_timeout: float = 180.0
    migrate_timeout: float = 300.0
    companion_timeout: float = 120.0
    model: object = None
    trigger_default: str = "resize"
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    checkpoint_auto: bool = False  # no --checkpoint-every: the launcher decides again once it knows the node sizes
    placement: str = "packed"
    resume: bool = False
    requeued: int = 0  # Slurm restarted the batch script after its node failed (launcher.loop.suspend.requeued_job)
    successor_of: str | None = None  # this run is the successor of that Slurm job (launcher.backends.slurm.successor)
    successor_why: str = ""  # why it takes over (that job ended, or lost its batch node)
    release_early: bool = False  # migrations free old tensors as they are sent (lower peak memory)
    node_gpus: tuple[int, ...] = ()  # local backend, uneven nodes: GPUs of each simulated node
    mode: str = "auto"  # live | restart | auto (restart until the workers join through launcher.runtime)
    term_timeout: float = 30.0
    max_restarts: int = 3
    policy: str = "manual"  # manual | opportunistic (launcher.policy.opportunistic)
    policy_idle: float = 30.0
    policy_dwell: float = 60.0
    policy_max_per_hour: int = 12
    policy_watch: float = 30.0  # seconds between looks at the partition (launcher.loop.autoscale)


def options_from_args(args: argparse.Namespace) -> Options:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("give the worker command after `--`, e.g. -- python -m launcher.worker --layers 8")
    lo, hi = parse_nnodes(args.nnodes)
    node_gpus = _node_gpus(args)
    gpn = max(node_gpus) if node_gpus else int(args.gpus_per_node or os.environ.get("SLURM_GPUS_ON_NODE", "1") or 1)
    if gpn < 1:
        raise UsageError(f"--gpus-per-node must be at least 1, got {gpn}")
    if gpn > MAX_GPUS_PER_NODE:
        given = "" if node_gpus or args.gpus_per_node else " (from $SLURM_GPUS_ON_NODE)"
        raise UsageError(f"--gpus-per-node {gpn}{given}: at most {MAX_GPUS_PER_NODE} GPUs per node")
    from launcher.runtime.torchrun_exec import missing_program

    missing = missing_program(command)
    if missing:
        raise UsageError(missing)
    layouts = parse_layouts(args.layouts)
    model = model_from_command(command)
    if args.companion_timeout <= 0:
        raise UsageError(f"--companion-timeout must be a positive number of seconds, got {args.companion_timeout}")
    if args.term_timeout < 0 or args.max_restarts < 0:
        raise UsageError("--term-timeout and --max-restarts must not be negative")
    if args.policy_idle < 0 or args.policy_dwell < 0 or args.policy_max_per_hour < 1 or args.policy_watch < 0.5:
        raise UsageError("--policy-idle and --policy-dwell must not be negative, --policy-max-per-hour at least 1, "
                         "--policy-watch at least 0.5 (seconds)")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be 0 (off) or a number of steps, got {args.checkpoint_every}")
    from launcher.policy.layouts import NoLayoutError, check_node_range
    from launcher.runtime.threads import nice_from_env
    from migrate.cma import enabled_from_env as cma_enabled_from_env

    try:
        nice_from_env()  # the workers inherit it (launcher.runtime.threads): refused here, before any starts
        cma_enabled_from_env()  # the same (migrate.cma)
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    try:
        check_node_range(lo, hi, gpn, layouts, model, node_gpus)
    except NoLayoutError as exc:
        raise UsageError(f"--layouts/--nnodes: {exc}") from None
    return Options(lo, hi, gpn, layouts, command, db_url=args.db, on_signal=args.on_signal,
                   job_name=args.job_name or os.environ.get("SLURM_JOB_NAME") or "elastic",
                   master_addr=args.master_addr or "127.0.0.1", master_port=args.master_port, poll=args.poll,
                   ready_timeout=args.ready_timeout, migrate_timeout=args.migrate_timeout,
                   companion_timeout=args.companion_timeout, model=model,
                   checkpoint_dir=args.checkpoint_dir, resume=args.resume, placement=args.placement,
                   release_early=args.release_early, node_gpus=node_gpus, mode=args.mode,
                   term_timeout=args.term_timeout, max_restarts=args.max_restarts, policy=args.policy,
                   policy_idle=args.policy_idle, policy_dwell=args.policy_dwell,
                   policy_max_per_hour=args.policy_max_per_hour, policy_watch=args.policy_watch,
                   checkpoint_every=auto_checkpoint_every(lo, hi, node_gpus or gpn, layouts, model, args.placement)
                   if args.checkpoint_every is None else args.checkpoint_every,
                   checkpoint_auto=args.checkpoint_every is None)


def _node_gpus(args: argparse.Namespace) -> tuple[int, ...]:
    """`--gpus-per-node 4,4,2,2`: one count per simulated node (local backend only; on Slurm the
    counts are the allocation's). A single count gives () (all nodes alike)."""
    text = args.gpus_per_node
    if text is None or "," not in str(text):
        try:
            int(text or 1)
        except ValueError:
            raise UsageError(f"--gpus-per-node takes a count or counts per node like 4,4,2,2, got {text!r}") from None
        return ()
    sizes = tuple(parse_node_sizes(text))
    slurm = args.backend == "slurm" or (args.backend == "auto" and (args.job_id or os.environ.get("SLURM_JOB_ID")))
    if slurm:
        raise UsageError("--gpus-per-node with one count per node is for the local backend; on Slurm the GPUs "
                         "of each node are the allocation's")
    if args.local_nodes not in (None, len(sizes)):
        raise UsageError(f"--local-nodes {args.local_nodes} but --gpus-per-node names {len(sizes)} nodes")
    if parse_nnodes(args.nnodes)[1] > len(sizes):
        raise UsageError(f"--nnodes {args.nnodes} asks for more nodes than the {len(sizes)} of --gpus-per-node")
    return sizes


def parse_node_sizes(text: str) -> list[int]:
    """`8` or `4,4,2,2` -> GPU counts; a clear error for anything else."""
    try:
        sizes = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise UsageError(f"--gpus-per-node takes a count or counts per node like 4,4,2,2, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--gpus-per-node must be at least 1 per node, got {text!r}")
    return sizes


def default_checkpoint_dir(db_url: str | None, job_name: str) -> Path:
    """checkpoints/<job> next to a SQLite database file, else ./var/checkpoints/<job>."""
    if db_url and db_url.startswith("sqlite:///") and len(db_url) > len("sqlite:///"):
        return Path(db_url[len("sqlite:///"):]).parent / "checkpoints" / job_name
    return Path("var") / "checkpoints" / job_name
