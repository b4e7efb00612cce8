"""The job's successor: a copy of its batch script, held in the queue while the launcher lives, that takes the
job over when the batch node (and with it elastic-launch) is lost.

Why not `sbatch --requeue`: on Slurm 22.05 a --no-kill job whose batch node dies is not requeued (Slurm takes
the node out, kills the batch step, and the job runs on without it), and a job requeued without --no-kill
waited for minutes with the dead node still listed and lost its GPU bookkeeping (the guide's
"Failures and what survives"). Why not `--dependency=afterany`: that --no-kill job never ends (measured: it ran on, batch step
gone, until cancelled). So the successor is a dead man's switch with Slurm as the timer: it is submitted with
`--begin=now+HOLD_S`, and the launcher pushes its start time back every POSTPONE_S. When the launcher dies,
nobody pushes; within HOLD_S the successor becomes eligible, starts on whatever nodes the partition has for
it (`--nodes=MIN-MAX`), and its elastic-launch (told ELASTIC_SUCCESSOR_OF=<job>) looks at the predecessor
(`takeover_reason`): ended, or its batch node down -- it cancels what is left of it and resumes the same job
from the newest complete safety checkpoint (launcher.loop.suspend.requeued_job); alive (slurmctld was merely
unreachable for a while, so the pushes failed) -- nothing to take over, and the launcher queues a new
successor when it sees its own gone. A launcher that ends the job itself cancels its successor first.
"""
from __future__ import annotations

import os
import time

from launcher.backends.slurm.parse import GONE_STATES

SUCCESSOR_ENV = "ELASTIC_SUCCESSOR_OF"  # the Slurm job a successor takes over
HOLD_S = 90  # how far ahead the successor's start is held: the launcher's silence it takes to start it
POSTPONE_S = 30.0  # how often the launcher pushes it back (two pushes may fail before it starts): 2 RPCs a minute


def successor_args(job_id: int | str, job_name: str, workdir: str, min_nodes: int, max_nodes: int,
                   hold_s: int = HOLD_S) -> list[str]:
    """sbatch options of job `job_id`'s successor (the batch script's own #SBATCH lines give the rest)."""
    return [f"--begin=now+{hold_s}", f"--job-name={job_name}", f"--chdir={workdir}",
            f"--nodes={min_nodes}-{max_nodes}" if max_nodes > min_nodes else f"--nodes={min_nodes}"]


class Successor:
    """Job `job_id`'s successor in the queue: submitted, pushed back while the launcher lives, cancelled when
    the launcher ends the job itself. `slurm`: a launcher.backends.slurm.client.SlurmCommands."""

    def __init__(self, slurm, job_id: int, job_name: str, min_nodes: int, max_nodes: int) -> None:
        self.slurm, self.job_id, self.job_name = slurm, job_id, job_name
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.id: int | None = None
        self.pushed = 0.0

    def submit(self) -> int:
        script = self.slurm.batch_script(self.job_id)
        self.id = self.slurm.submit(script, env={SUCCESSOR_ENV: str(self.job_id)},
                                    extra_args=successor_args(self.job_id, self.job_name, os.getcwd(),
                                                              self.min_nodes, self.max_nodes))
        self.pushed = time.monotonic()
        return self.id

    def keep(self) -> str | None:
        """Push the successor's start back (every POSTPONE_S at most); one queued anew where it is gone (it
        started while slurmctld did not answer the pushes, found the launcher alive and left). Returns what
        was done worth saying, or None."""
        if self.id is None or time.monotonic() - self.pushed < POSTPONE_S:
            return None
        self.pushed = time.monotonic()
        try:
            self.slurm.hold(self.id, HOLD_S)
            return None
        except Exception as exc:  # noqa: BLE001 -- gone, or slurmctld away: look at it
            pending = self._pending()
            if pending is None or pending:
                return f"holding successor job {self.id} failed ({exc}); trying again"
        old = self.id
        return f"successor job {old} is gone; queued job {self.submit()} instead"

    def _pending(self) -> bool | None:
        try:
            return self.slurm.job_info(self.id).state == "PENDING"
        except Exception:  # noqa: BLE001 -- no answer: cannot tell
            return None

    def cancel(self) -> None:
        if self.id is not None:
            self.slurm.cancel(self.id)
            self.id = None


def predecessor(env=os.environ) -> str | None:
    """The Slurm job this batch script was queued to take over (None: it is no successor)."""
    value = env.get(SUCCESSOR_ENV, "")
    return value if value.isdigit() else None


class JobCancelled(Exception):
    """The predecessor was cancelled (scancel, by its user or an admin) with its batch node up: not a loss to
    recover from, so the successor leaves it ended. The message says how to resume it by hand."""


def takeover_reason(slurm, job_id: int | str) -> str | None:
    """Why the successor of Slurm job `job_id` may take the job over now -- after cancelling what is left of
    the predecessor -- or None when its launcher may be alive (the job runs and its batch node is up)."""
    try:
        info = slurm.job_info(int(job_id))
    except Exception:  # noqa: BLE001 -- not known any more: ended long ago
        return "it has ended"
    batch = info.batch_host
    if info.state not in ("RUNNING", "SUSPENDED", "RESIZING", "CONFIGURING", "COMPLETING"):
        if info.state == "CANCELLED" and batch:
            state, answering = slurm.node_states([batch]).get(batch, ("", False))
            if answering and state not in GONE_STATES:  # a launcher killed before it could cancel its successor
                raise JobCancelled(f"Slurm job {job_id} was cancelled (scancel) with its batch node {batch} up: "
                                   "a cancelled job is not taken over; `elastic-launch --resume` resumes it by hand")
        return f"it has ended ({info.state})"
    states = slurm.node_states([batch]) if batch else {}
    state, _answering = states.get(batch, ("", True))  # unanswered pings alone: a busy slurmd, maybe
    if batch and (state in GONE_STATES or batch not in info.nodes):
        slurm.cancel(int(job_id))
        return f"it lost its batch node {batch} ({state or 'taken out of the job'}); what was left of it is cancelled"
    return None
