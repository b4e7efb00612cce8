"""The job's successor: a copy of its batch script, queued behind it, that takes the job over if the batch
node (and with it elastic-launch) is lost.

Why not `sbatch --requeue`: on Slurm 22.05 a --no-kill job whose batch node dies is not requeued (Slurm takes
the node out and kills the batch step), and a job requeued without --no-kill waited for minutes with the dead
node still listed and lost its GPU bookkeeping (README, "What a job survives"). A second job is Slurm's own
machinery and needs no daemon: submitted when the launcher starts, with `--dependency=afterany:<job>`, it waits
in the queue (reason Dependency) while the job runs, starts on whatever nodes are left once the job has ended
by any cause, and its elastic-launch, told ELASTIC_SUCCESSOR_OF=<job>, resumes the same job in the database
from the newest complete safety checkpoint (launcher.loop.suspend.requeued_job). A launcher that ends the job
itself -- finished, stopped, suspended, failed, cancelled -- cancels its successor first (SlurmNodes.close);
a successor that finds the job ended cleanly anyway has nothing to take over and says so.
"""
from __future__ import annotations

import os

SUCCESSOR_ENV = "ELASTIC_SUCCESSOR_OF"  # the Slurm job a successor takes over


def successor_args(job_id: int | str, job_name: str, workdir: str) -> list[str]:
    """sbatch options of job `job_id`'s successor (the batch script's own #SBATCH lines give the rest): queued
    behind it whatever way it ends, gone with it when that can never happen, the same name, the same folder."""
    return [f"--dependency=afterany:{job_id}", "--kill-on-invalid-dep=yes", f"--job-name={job_name}",
            f"--chdir={workdir}"]


def submit_successor(slurm, job_id: int, job_name: str) -> int:
    """Queue job `job_id`'s successor: its own batch script (as Slurm keeps it), resubmitted; its Slurm id."""
    script = slurm.batch_script(job_id)
    return slurm.submit(script, env={SUCCESSOR_ENV: str(job_id)},
                        extra_args=successor_args(job_id, job_name, os.getcwd()))


def predecessor(env=os.environ) -> str | None:
    """The Slurm job this batch script was queued to take over (None: it is no successor)."""
    value = env.get(SUCCESSOR_ENV, "")
    return value if value.isdigit() else None
