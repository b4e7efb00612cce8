"""`elastic-launch`: the entry point that runs an elastic training job, inside a Slurm allocation or on this machine.

Put it in the sbatch script (use `exec` so the batch step's USR1 reaches it):

    #SBATCH --nodes=4 --gres=gpu:4 --signal=B:USR1@60
    exec elastic-launch --nnodes 2:4 --gpus-per-node 4 --layouts pp4tp2,pp2tp4,pp2tp2 \\
        --db sqlite:///${TMPDIR:-/tmp}/elastic-$SLURM_JOB_ID.db -- python -m launcher.worker --layers 24 --hidden 512

The flags are read and checked (launcher.options), the node backend is picked (launcher.backends),
and the job's control loop (launcher.loop.launcher.Launcher) runs until the job ends. Every trigger --
`elastic resize`/`elastic preempt`/dashboard requests from the database, USR1, a worker that dies
-- becomes one migration (launcher.loop.outcome): pick the layout (launcher.policy.layouts), plan it
(migrate.plan), post it, let the workers apply it at one agreed step boundary, let departing
workers exit, give their nodes back, and record the rank map and the migration with its phases
in the database. A failed migration or node release leaves the job on its old layout, with the
failure recorded.

Growing beyond the nodes the job holds asks the backend for more (on Slurm a companion job,
launcher.backends.slurm.nodes); one that never starts is cancelled and the grow is recorded as failed
while the job trains on. Suspend and resume through a checkpoint: launcher.loop.suspend. With
--checkpoint-every N the workers also keep one complete safety checkpoint; a failure no replica
can recover from (DP = 1) restarts the workers from it, recording how many committed steps were lost.
"""
from __future__ import annotations

import os
import sys

from launcher.backends import make_backend, shell_line
from launcher.database import db_url, open_store
from launcher.errors import NothingToDo, UsageError
from launcher.loop.launcher import Launcher, grow_choice
from launcher.options import Options, build_parser, options_from_args, parse_layouts, parse_nnodes
from launcher.loop.start_request import StartRequest
from launcher.loop.outcome import MigrationFailed, Outcome
from service.errors import ServiceError

__all__ = ["Launcher", "MigrationFailed", "Options", "Outcome", "build_parser", "dry_run", "grow_choice", "main",
           "options_from_args", "parse_layouts", "parse_nnodes"]


def dry_run(opts: Options, backend, db_url: str | None, out=None) -> None:
    """Print the start request's command lines (environment included) and the release of a shrink to
    --nnodes MIN; starts and writes nothing."""
    out = out or sys.stdout
    nodes = backend.allocation()[:opts.max_nodes]
    request = StartRequest.for_job(opts, db_url, opts.master_port or None, backend)
    print(f"# {backend.describe()}", file=out)
    print(f"# start: workers on {len(nodes)} node(s)", file=out)
    for cmd in request.commands(backend, nodes):
        print(shell_line(cmd), file=out)
    keep = nodes[:opts.min_nodes]
    if len(keep) < len(nodes):
        print(f"# shrink to --nnodes minimum {opts.min_nodes} (after moving the state off the other nodes)", file=out)
        for cmd in backend.commands_for_release(keep) or [["# (local backend: the workers exit; nothing to run)"]]:
            print(shell_line(cmd) if not cmd[0].startswith("#") else cmd[0], file=out)


def check_allocation(opts: Options, backend) -> None:
    """The node range against the nodes as the backend holds them: on Slurm the GPUs of each node are
    known only once the allocation is read (uneven nodes, a heterogeneous job), so a --layouts list that
    fits --gpus-per-node everywhere may not fit them. A UsageError before anything starts."""
    from launcher.policy.layouts import NoLayoutError, check_node_range

    sizes = tuple(backend.gpus_on(n) for n in backend.allocation())
    if opts.node_gpus or len(set(sizes)) < 2:
        return  # checked by options_from_args already
    try:
        check_node_range(opts.min_nodes, min(opts.max_nodes, len(sizes)), opts.gpus_per_node, opts.layouts,
                         opts.model, sizes)
    except NoLayoutError as exc:
        raise UsageError(f"--layouts/--nnodes on the allocation's nodes ({backend.describe()}): {exc}") from None


def check_resumable(opts: Options, store, slurm_job_id: str | None = None, backend=None) -> None:
    """--resume with no checkpoint to go on from: a UsageError before any worker starts (else the workers
    start, and the run fails only once they registered). Restart mode's scripts resume from their own.

    A batch script Slurm requeued after its node failed resumes the job its previous run drove by itself
    (launcher.loop.suspend.requeued_job); with nothing to resume from, that job ends as failed, saying why."""
    from launcher.backends.slurm.successor import JobCancelled, predecessor
    from launcher.loop.suspend import nothing_to_resume, requeued_job, resume_checkpoint
    from launcher.loop.start_request import checkpoint_dir

    successor_of = predecessor()
    requeued = None if opts.resume else requeued_job(store, opts.job_name, slurm_job_id, successor_of=successor_of)
    if requeued is not None:
        opts.resume, opts.requeued = True, int(os.environ.get("SLURM_RESTART_COUNT") or 0) or 1
        opts.successor_of = successor_of
        if successor_of is not None:
            try:
                opts.successor_why = backend.takeover_reason(successor_of) if backend is not None else "its job ended"
            except JobCancelled as exc:
                store.set_job_state(requeued.id, "stopped")
                store.close()
                raise NothingToDo(f"successor of Slurm job {successor_of}: {exc}") from None
            if opts.successor_why is None:
                store.close()
                raise NothingToDo(f"successor of Slurm job {successor_of}: that job runs and its batch node is up "
                                  "(its launcher was only out of touch with slurmctld); nothing to take over -- it "
                                  "queues a new successor")
    elif successor_of is not None:
        job = store.find_job(opts.job_name)
        store.close()
        raise NothingToDo(f"successor of Slurm job {successor_of}: job {opts.job_name} is "
                          f"{job.state if job is not None else 'not in the database'}"
                          f"{'' if job is None else f' (Slurm job {job.slurm_job_id})'}; nothing to take over")
    if not opts.resume or opts.mode == "restart":
        return
    ckpt_dir = checkpoint_dir(opts, store.url)
    if resume_checkpoint(store.find_job(opts.job_name), ckpt_dir, bool(opts.requeued)) is None:
        why = nothing_to_resume(opts.job_name, ckpt_dir)
        if requeued is not None:
            lost = "Slurm requeued job {} after its node failed" if successor_of is None else \
                "the successor of job {} found its launcher gone"
            why = (f"{lost.format(opts.job_name)}, but {why}; start it again without --resume, and give it "
                   "--checkpoint-every N to survive this")
            store.set_job_state(requeued.id, "failed", why=why)
        store.close()
        raise UsageError(why)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        opts = options_from_args(args)
        backend, slurm_job_id = make_backend(args.backend, job_id=args.job_id, gpus_per_node=opts.gpus_per_node,
                                             min_nodes=opts.min_nodes, max_nodes=opts.max_nodes,
                                             local_nodes=args.local_nodes, log_dir=args.log_dir,
                                             fork_server=not args.fresh_processes,
                                             node_gpus=opts.node_gpus)
        check_allocation(opts, backend)
        if hasattr(backend, "read_age_s"):  # Slurm: the policy's partition is read at least every --policy-watch
            backend.read_age_s = min(backend.read_age_s, opts.policy_watch)
        if opts.policy == "opportunistic" and backend.cluster_view() is None:
            raise UsageError("--policy opportunistic reads a Slurm partition's idle nodes and queue, and none could "
                             "be read: run it in an sbatch allocation (the local backend has neither)")
        if args.master_addr is None:
            opts.master_addr = backend.default_master_addr()
        if args.dry_run:
            dry_run(opts, backend, db_url(args.db))
            return 0
        store = open_store(args.db, create=True)
        check_resumable(opts, store, slurm_job_id, backend)
    except (UsageError, ServiceError) as exc:
        print(f"elastic-launch: error: {exc}", file=sys.stderr)
        return 2
    except NothingToDo as exc:
        print(f"elastic-launch: {exc}", file=sys.stderr)
        return 0
    try:
        return Launcher(opts, backend, store, slurm_job_id=slurm_job_id).run()
    except KeyboardInterrupt:
        print("elastic-launch: interrupted", file=sys.stderr)
        return 130
    except MigrationFailed as exc:
        print(f"elastic-launch: cannot start the job: {exc}", file=sys.stderr)
        return 1
    except ServiceError as exc:  # the shared service refused a write (not this user's job) or went away
        print(f"elastic-launch: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
