"""Slurm command lines, built and not run: argv lists (and the companion's batch script), checked
against golden files.

Kept apart from running them (launcher.backends.slurm.client), the way submitit builds its
sbatch/srun lines, so what runs can be read and tested without a cluster.
"""
from __future__ import annotations

import re
import signal as signal_module
from pathlib import Path
from typing import Mapping, Sequence

from launcher.backends.slurm.hostlist import compress_hostlist
from launcher.policy.peers import companion_mark

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def build_srun_command(job_id: int | str, nodes: Sequence[str], ntasks_per_node: int,
                       gpus_per_node: int, env: Mapping[str, str], argv: Sequence[str],
                       overlap: bool = True, het_group: int | None = None, gpus_per_step: bool = False,
                       gres_none: bool = False) -> list[str]:
    """srun line for one step on chosen nodes of a running job.

    GPUs: `--gres=gpu:G` per node; `gpus_per_step=True` asks `--gpus=<G x nodes>` instead, for a
    plain job whose nodes hold different GPU counts (`sbatch --gpus=N` or `--exclusive` on uneven
    nodes): Slurm 22.05 refuses `--gres=gpu:G` (and `--gpus-per-node=G`) steps there when G is above
    the job's smallest per-node share ("Step requested gres_per_node=gpu:4 is more than the job's
    gres_per_node=gpu:2"), while a one-node step with `--gpus=4` gets the node's 4. Slurm 24.11 and
    26.05 start `--gres=gpu:G` steps there, and a `--gpus=G` step only while no other such step runs
    (measured): launcher.backends.slurm.nodes asks `--gpus` of 22.05 only.

    In a heterogeneous job `job_id` is the leader's id and `het_group` the component's offset:
    Slurm 22.05 refuses a component's own id ("Job not heterogeneous job leader") and, without
    --het-group, starts steps in component 0 only.

    `--overlap` because the launcher starts steps next to the batch step and
    next to steps it is replacing; without it srun waits forever ("Requested
    nodes are busy"). The environment is put on the command line through
    `env NAME=VALUE` so values with commas survive (srun --export splits on
    commas) and so the built command alone says exactly what runs.
    """
    if not nodes:
        raise ValueError("build_srun_command: nodes is empty; a step needs at least one node")
    if ntasks_per_node < 1:
        raise ValueError(f"build_srun_command: ntasks_per_node must be >= 1, got {ntasks_per_node}")
    if gpus_per_node < 0:
        raise ValueError(f"build_srun_command: gpus_per_node must be >= 0, got {gpus_per_node}")
    if not argv:
        raise ValueError("build_srun_command: argv is empty; give the program to run")
    cmd = [
        "srun", f"--jobid={job_id}", *([f"--het-group={het_group}"] if het_group is not None else []),
        f"--nodes={len(nodes)}",
        f"--nodelist={compress_hostlist(nodes)}", f"--ntasks-per-node={ntasks_per_node}",
        f"--ntasks={ntasks_per_node * len(nodes)}",
    ]
    if gres_none:  # a requeued job whose GPUs Slurm lost (launcher.backends.slurm.health.lost_gres)
        cmd.append("--gres=none")
    elif gpus_per_node:
        cmd.append(f"--gpus={gpus_per_node * len(nodes)}" if gpus_per_step else f"--gres=gpu:{gpus_per_node}")
    if overlap:
        cmd.append("--overlap")
    cmd.append("--kill-on-bad-exit=0")
    if env:
        cmd += ["env"] + [f"{k}={v}" for k, v in _checked_env(env)]
    return cmd + list(argv)


def env_outside_job(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the SLURM_* variables of the job this process runs in (SLURM_CONF kept): for
    srun/sbatch aimed at another job, so none of this job's settings leak into it."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def _checked_env(env: Mapping[str, str]) -> list[tuple[str, str]]:
    items = sorted(env.items())
    for key, _ in items:
        if not _ENV_NAME.match(key):
            raise ValueError(f"environment variable name {key!r} is not a valid shell name")
    return [(k, str(v)) for k, v in items]


def build_shrink_command(job_id: int | str, keep_nodes: Sequence[str]) -> list[str]:
    """`scontrol update JobId=X NodeList=...`: Slurm releases every node not listed.

    NodeList (not NumNodes) so the caller decides which nodes go: the batch
    host must stay, and the launcher moves state off the others first.
    """
    if not keep_nodes:
        raise ValueError("build_shrink_command: keep_nodes is empty; cancel the job instead")
    return ["scontrol", "update", f"JobId={job_id}", f"NodeList={compress_hostlist(keep_nodes)}"]


def build_show_job_command(job_id: int | str, detail: bool = False) -> list[str]:
    """`scontrol show job X` (22.05's scontrol has no --json); `-d` adds GRES per node
    (launcher.backends.slurm.allocation reads it)."""
    return ["scontrol", "show", *(["-d"] if detail else []), "job", str(job_id)]


def build_admin_level_command(user: str) -> list[str]:
    """`sacctmgr show user U format=adminlevel`: None, Operator or Administrator in Slurm's accounting."""
    return ["sacctmgr", "-nP", "show", "user", user, "format=adminlevel"]


def build_squeue_command(job_ids: Sequence[int | str] = (), fmt: str | None = None) -> list[str]:
    """`squeue --json`, optionally limited to some jobs; `fmt` names the JSON format (v0.0.42), where the
    release has named ones (launcher.backends.slurm.slurm_json.json_format)."""
    cmd = ["squeue", f"--json={fmt}" if fmt else "--json"]
    if job_ids:
        cmd.append(f"--jobs={','.join(str(j) for j in job_ids)}")
    return cmd


def build_sinfo_command(fmt: str | None = None) -> list[str]:
    """`sinfo --json` (`--json=v0.0.42` with a named format)."""
    return ["sinfo", f"--json={fmt}" if fmt else "--json"]


def build_node_states_command(nodes: Sequence[str]) -> list[str]:
    """One line per node: its name and state, `*` appended while it does not answer slurmctld's pings."""
    return ["sinfo", "--noheader", "--Node", f"--nodes={compress_hostlist(nodes)}", "--format=%N %T"]


def build_submit_line_command(job_id: int | str) -> list[str]:
    """The sbatch command line a job was submitted with (accounting: slurmdbd keeps it)."""
    return ["sacct", f"--jobs={job_id}", "--allocations", "--noheader", "--parsable2", "--format=SubmitLine"]


def build_batch_script_command(job_id: int | str) -> list[str]:
    """A batch job's script, printed to stdout."""
    return ["scontrol", "write", "batch_script", str(job_id), "-"]


def build_sbatch_command(script_path: str | Path | None = None,
                         extra_args: Sequence[str] = ()) -> list[str]:
    """`sbatch --parsable [args] [script]`; without a path the script comes on stdin."""
    cmd = ["sbatch", "--parsable", *extra_args]
    if script_path is not None:
        cmd.append(str(script_path))
    return cmd


def companion_job_name(job_name: str, n: int) -> str:
    """Name of the n-th companion job of `job_name` (n counts from 1 for the launcher's lifetime)."""
    return f"{job_name}-companion-{n}"


def build_companion_args(job_name: str, n: int, nodes: int, gpus_per_node: int, partition: str = "",
                         exclude: Sequence[str] = (), output: str | Path | None = None,
                         of_job: int | str | None = None, whole: bool = False) -> list[str]:
    """sbatch options of a companion job: `nodes` more whole nodes for a running elastic job.

    Slurm 22.05 cannot grow a job that holds GRES (`--dependency=expand` fails with "has
    allocated GRES") and never gives a job its released nodes back, so the launcher asks for
    the extra nodes as a second batch job in the same partition, with the same GPUs and tasks
    per node, and starts the workers on them as steps of that job. `exclude` keeps the
    companion off nodes the job already holds (the scheduler would otherwise pack it onto their
    free cores). `--no-requeue`: a companion that lost a node must not come back on its own;
    `--no-kill`: one of its nodes crashing must not take the others (launcher.loop.probe). `whole`
    (`--exclusive`): whole nodes, as --policy opportunistic counts idle nodes and grows onto them: measured on
    the testbed, two elastic jobs' companions packed onto one node's free GPUs, so a yield released no whole
    node and the other job yielded again for the same pending job. `of_job`: the
    main job, named in the comment so that other elastic jobs' policies know the pending companion for a
    grow, not work to yield to, and count its nodes as this job's (launcher.policy.peers).
    """
    if nodes < 1:
        raise ValueError(f"build_companion_args: nodes must be >= 1, got {nodes}")
    if gpus_per_node < 1:
        raise ValueError(f"build_companion_args: gpus_per_node must be >= 1, got {gpus_per_node}")
    args = [f"--job-name={companion_job_name(job_name, n)}"]
    if partition:
        args.append(f"--partition={partition}")
    args += [f"--nodes={nodes}", f"--gres=gpu:{gpus_per_node}", f"--ntasks-per-node={gpus_per_node}"]
    if exclude:
        args.append(f"--exclude={compress_hostlist(exclude)}")
    args += [*(["--exclusive"] if whole else []), "--no-requeue", "--no-kill"]
    if of_job is not None:
        args.append(f"--comment={companion_mark(of_job)}")
    if output is not None:
        args.append(f"--output={output}")
    return args


def build_companion_script(main_job_id: int | str, poll_s: int = 5) -> str:
    """The companion job's batch script: it only holds the nodes. The launcher starts the workers
    as steps of this job (`srun --jobid=<companion> --overlap ...`, the same environment as the
    workers of its own job: ELASTIC_STORE, MASTER_ADDR, MASTER_PORT, ELASTIC_NODE_INDEX), so they
    join the launcher's control plane. The script ends by itself once the main job is gone (not
    when slurmctld merely does not answer), so a launcher that died leaves no companion behind."""
    return f"""#!/bin/bash
# Companion of Slurm job {main_job_id}: holds nodes; elastic-launch starts the workers as steps of this job.
while :; do
    state=$(scontrol show job {main_job_id} 2>&1)
    case "$state" in
        *JobState=RUNNING*|*JobState=SUSPENDED*) ;;
        *JobState=*|*"Invalid job id"*) exit 0 ;;
    esac
    sleep {poll_s}
done
"""


def build_companion_command(job_name: str, n: int, nodes: int, gpus_per_node: int, partition: str = "",
                            exclude: Sequence[str] = (), output: str | Path | None = None,
                            of_job: int | str | None = None, whole: bool = False) -> list[str]:
    """The full sbatch line of a companion job (its script, build_companion_script, goes on stdin)."""
    return build_sbatch_command(None, build_companion_args(job_name, n, nodes, gpus_per_node, partition,
                                                           exclude, output, of_job, whole))


def build_hold_command(job_id: int | str, seconds: int) -> list[str]:
    """`scontrol update JobId=X StartTime=now+N`: a pending job is not started before then."""
    return ["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{int(seconds)}"]


def build_comment_command(job_id: int | str, comment: str) -> list[str]:
    """`scontrol update JobId=X Comment=...`: what squeue shows every user (launcher.policy.peers' marks)."""
    return ["scontrol", "update", f"JobId={job_id}", f"Comment={comment}"]


def build_cancel_command(job_id: int | str) -> list[str]:
    return ["scancel", str(job_id)]


def build_signal_command(job_id: int | str, sig: int | str, batch: bool = False) -> list[str]:
    """`scancel --signal=SIG [--batch] JOB`: steps only by default, the batch shell with batch=True."""
    cmd = ["scancel", f"--signal={signal_name(sig)}"]
    if batch:
        cmd.append("--batch")
    return cmd + [str(job_id)]


def build_steps_command(job_id: int | str) -> list[str]:
    """`squeue --steps` of one job: one `STEPID NODELIST` line per step (batch and extern included)."""
    return ["squeue", "--steps", f"--jobs={job_id}", "--noheader", "--format=%i %N"]



def signal_name(sig: int | str) -> str:
    """Signal.SIGUSR1, 10, 'USR1' and 'SIGUSR1' all become 'USR1' (scancel's spelling)."""
    if isinstance(sig, str):
        name = sig.upper()
        return name[3:] if name.startswith("SIG") else name
    return signal_module.Signals(sig).name[3:]
