"""Who may do what to a job: Slurm's own model, which the cluster's users know.

A job belongs to the Unix user whose launcher created it. Its owner may see it and resize, suspend and resume
it; operators (a configured Unix group, and root) may act on every job and are the only ones who may preempt;
everyone may see other users' jobs unless the site hides them (`private_jobs`, like Slurm's PrivateData=jobs).
A job recorded before owners were (schema v12) belongs to nobody: operators only. Pure: no I/O."""
from __future__ import annotations

from dataclasses import dataclass

from db.records import Job
from service.identity import Caller

OPERATOR_ACTIONS = frozenset({"preempt"})  # takes GPUs from a job for someone else: the cluster's call


@dataclass(frozen=True)
class Decision:
    allowed: bool
    why: str = ""

    def __bool__(self) -> bool:
        return self.allowed


ALLOWED = Decision(True)


def may_see(caller: Caller, job: Job, private_jobs: bool) -> Decision:
    if caller.operator or not private_jobs or (job.owner is not None and job.owner == caller.user):
        return ALLOWED
    return Decision(False, f"job {job.id} is not yours and this site keeps jobs private")


def may_act(caller: Caller, job: Job, action: str) -> Decision:
    """Whether `caller` may ask `action` of `job` (a request, a policy switch, or a launcher's write)."""
    if caller.operator:
        return ALLOWED
    if action in OPERATOR_ACTIONS:
        return Decision(False, f"{action} is for operators only (the service's operators group); ask one, or "
                               f"shrink your own job with `elastic resize`")
    if job.owner is None:
        return Decision(False, f"job {job.id} has no recorded owner (it predates owners): only an operator may "
                               f"{action} it")
    if job.owner != caller.user:
        return Decision(False, f"job {job.id} ({job.name}) belongs to {job.owner}: only its owner or an operator "
                               f"may {action} it")
    return ALLOWED


def owner_filter(caller: Caller, private_jobs: bool) -> str | None:
    """The owner a listing is narrowed to: the caller's own jobs where others' are hidden from them."""
    return None if caller.operator or not private_jobs else caller.user
