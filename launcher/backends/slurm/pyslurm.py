"""The optional pyslurm client: Slurm queries and job changes through pyslurm's job API.

Only chosen (launcher.backends.slurm.select) when the installed pyslurm was built
for the cluster's Slurm major.minor; on Debian 12 (Slurm 22.05) none exists on PyPI, so this
client has only run against a stand-in module in the tests, never against a real pyslurm.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from launcher.backends.slurm.client import DEFAULT_TIMEOUT_S, Runner, SlurmCommands, SlurmError
from launcher.backends.slurm.commands import signal_name
from launcher.backends.slurm.hostlist import compress_hostlist, expand_hostlist
from launcher.backends.slurm.parse import JobInfo


class PyslurmBackend(SlurmCommands):
    """Backend using pyslurm's job API for queries and job changes (no fork per call).

    Submitting and starting steps still use sbatch/srun: pyslurm has no srun
    equivalent, and keeping one submission path keeps behaviour identical.
    Only built when pyslurm matches the cluster's Slurm version (see
    select_backend); on Debian 12 (Slurm 22.05) no such pyslurm exists on PyPI.
    """

    def __init__(self, pyslurm_module: Any, env: Mapping[str, str] | None = None,
                 runner: Runner | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(env=env, runner=runner, timeout=timeout)
        self.pyslurm = pyslurm_module

    def _call(self, what: str, hint: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # pyslurm raises RPCError and plain ValueErrors
            raise SlurmError(f"{what} failed (pyslurm): {exc}; {hint}") from exc

    def job_info(self, job_id: int) -> JobInfo:
        job = self._call(f"reading job {job_id}", "check the job id with `squeue`",
                         lambda: self.pyslurm.Job.load(job_id))
        return JobInfo(job_id=int(job.id), state=str(job.state),
                       nodes=expand_hostlist(job.allocated_nodes or ""),
                       batch_host=job.batch_host or None, num_nodes=int(job.num_nodes or 0),
                       name=job.name or "", reason=str(job.state_reason or ""),
                       partition=str(job.partition or ""))

    def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        # modify(nodes=...) is silently ignored by pyslurm; required_nodes shrinks.
        changes = self.pyslurm.JobSubmitDescription(required_nodes=compress_hostlist(keep_nodes))
        self._call(f"shrinking job {job_id} to {compress_hostlist(keep_nodes)}",
                   "keep_nodes must be a subset of the job's nodes that includes its batch host",
                   lambda: self.pyslurm.Job(job_id).modify(changes))

    def cancel(self, job_id: int) -> None:
        self._call(f"cancelling job {job_id}", "check the job id with `squeue`",
                   lambda: self.pyslurm.Job(job_id).cancel())

    def signal(self, job_id: int, sig: int | str, batch: bool = False) -> None:
        steps = "batch" if batch else "children"
        self._call(f"sending {signal_name(sig)} to job {job_id}", "the job must be running",
                   lambda: self.pyslurm.Job(job_id).send_signal(f"SIG{signal_name(sig)}", steps=steps))
