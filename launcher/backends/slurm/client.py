"""The Slurm client: runs the command lines of launcher.backends.slurm.commands and reads their
output with launcher.backends.slurm.parse.

One client interface (`SlurmClient`), two implementations: the Slurm command-line tools
(`SlurmCommands`, here) work against any cluster, while pyslurm is faster but must be built for
the cluster's exact Slurm major.minor (PyPI only has 25.11, Debian 12 ships 22.05). So
`SlurmCommands` is the default and `launcher.backends.slurm.pyslurm.PyslurmBackend` is picked only
when a matching pyslurm imports (launcher.backends.slurm.select). Running goes through a `Runner`
that tests replace, so Slurm's answers can be scripted without a cluster.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from launcher.backends.slurm.allocation import Allocation, parse_show_job_detail
from launcher.backends.slurm.commands import (
    build_admin_level_command,
    build_batch_script_command,
    build_cancel_command,
    build_comment_command,
    build_hold_command,
    build_node_states_command,
    build_sbatch_command,
    build_show_job_command,
    build_shrink_command,
    build_signal_command,
    build_sinfo_command,
    build_squeue_command,
    build_srun_command,
    build_steps_command,
    build_submit_line_command,
    env_outside_job,
    signal_name,
)
from launcher.backends.slurm.hostlist import compress_hostlist
from launcher.backends.slurm.parse import (
    JobInfo,
    NodeInfo,
    node_state_words,
    parse_node_states,
    parse_sbatch_output,
    parse_scontrol_show_job,
    parse_sinfo_json,
    parse_slurm_version,
    parse_squeue_json,
    parse_step_on_node,
    submitted_no_kill,
)
from launcher.backends.slurm.slurm_json import json_format

DEFAULT_TIMEOUT_S = 30.0
#: an answer slower than this means slurmctld is rate-limiting us (SlurmctldParameters=rl_enable: the client
#: library sleeps and asks again, silently) or is busy: the routine looks slow down (SlurmCommands.nodes)
SLOW_ANSWER_S = 3.0
MAX_BACKOFF = 4  # the routine looks at most this many times less often
_STATUS_HINT = "check that slurmctld is up (`scontrol ping`; for the local testbed `elastic testbed status`)"


class SlurmError(RuntimeError):
    """A Slurm operation failed. The message says what failed, Slurm's own
    words, and what to do next; the fields keep the raw details for callers."""

    def __init__(self, message: str, *, cmd: Sequence[str] | None = None,
                 returncode: int | None = None, stderr: str = "") -> None:
        super().__init__(message)
        self.cmd = list(cmd) if cmd else None
        self.returncode = returncode
        self.stderr = stderr



def _is_read(cmd: Sequence[str]) -> bool:
    """Whether `cmd` only reads Slurm's state (safe to ask twice)."""
    return cmd[:1] in (["squeue"], ["sinfo"], ["sacct"], ["sdiag"]) or cmd[:3] == ["sacctmgr", "-nP", "show"] or \
        (cmd[:1] == ["scontrol"] and len(cmd) > 1 and cmd[1] in ("show", "--version", "ping"))


# ------------------------------------------------------------------ running
Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def subprocess_runner(cmd: Sequence[str], *, input: str | None = None,
                      env: Mapping[str, str] | None = None,
                      timeout: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """The real runner: capture text output, never raise on a non-zero exit."""
    return subprocess.run(list(cmd), input=input, env=dict(env) if env is not None else None,
                          capture_output=True, text=True, timeout=timeout, check=False)


@runtime_checkable
class SlurmClient(Protocol):
    """What the launcher asks of Slurm. Both backends implement it."""

    def job_info(self, job_id: int) -> JobInfo: ...

    def jobs(self, max_age: float = 0.0) -> list[JobInfo]: ...

    def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None: ...

    def submit(self, script: str | Path, env: Mapping[str, str] | None = None,
               extra_args: Sequence[str] = ()) -> int: ...

    def cancel(self, job_id: int) -> None: ...

    def set_comment(self, job_id: int, comment: str) -> None: ...

    def hold(self, job_id: int, seconds: int) -> None: ...

    def signal(self, job_id: int, sig: int | str, batch: bool = False) -> None: ...

    def signal_step_on(self, job_id: int, node: str, sig: int | str) -> str | None: ...

    def nodes(self, max_age: float = 0.0) -> list[NodeInfo]: ...

    def node_states(self, nodes: Sequence[str], max_age: float = 0.0) -> dict[str, tuple[str, bool]]: ...

    def no_kill(self, job_id: int) -> bool | None: ...

    def batch_script(self, job_id: int) -> str: ...

    def probe_node(self, job_id: int, node: str, timeout: float, het_group: int | None = None,
                   gpus: int = 0) -> str | None: ...

    def start_step(self, job_id: int, nodes: Sequence[str], ntasks_per_node: int,
                   gpus_per_node: int, env: Mapping[str, str], argv: Sequence[str],
                   overlap: bool = True, other_job: bool = False, het_group: int | None = None,
                   gpus_per_step: bool = False, gres_none: bool = False, **popen_kwargs: Any) -> subprocess.Popen: ...


class SlurmCommands:
    """Default backend: runs the Slurm command-line tools.

    `env` is merged over os.environ for every command (typically
    `{"SLURM_CONF": ...}`); `runner` is replaceable so tests can script
    Slurm's answers without a cluster.
    """

    def __init__(self, env: Mapping[str, str] | None = None, runner: Runner | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.extra_env = dict(env or {})
        self.runner = runner or subprocess_runner
        self.timeout = timeout
        self._release: tuple[int, int] | None = None  # the tools' Slurm release, read on first need
        self._reads: dict[str, tuple[float, list]] = {}  # "nodes"/"jobs" -> (when, what was read): `_shared`
        self.backoff = 1  # routine reads are this many times older while slurmctld answers slowly
        self.say: Callable[[str], None] = lambda msg: print(f"[elastic-launch] {msg}", file=sys.stderr, flush=True)

    def _env(self, more: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(more or {})
        return env

    def _run(self, cmd: list[str], what: str, hint: str, *, input: str | None = None,
             env: Mapping[str, str] | None = None) -> str:
        """Run one command; turn every failure into a SlurmError that says what to do. A read that did not
        answer in time is asked once more, with twice the time: under Slurm's RPC rate limit a burst of
        requests waits its turn, and a read changes nothing when asked twice."""
        started = time.monotonic()
        try:
            try:
                result = self.runner(cmd, input=input, env=self._env(env), timeout=self.timeout)
            except subprocess.TimeoutExpired:
                if not _is_read(cmd):
                    raise
                self.say(f"slurmctld did not answer `{' '.join(cmd[:3])}` within {self.timeout:.0f} s "
                         f"(rate-limited or busy); asking again, for up to {2 * self.timeout:.0f} s")
                result = self.runner(cmd, input=input, env=self._env(env), timeout=2 * self.timeout)
            self._paced(cmd, time.monotonic() - started)
        except FileNotFoundError as exc:
            raise SlurmError(
                f"{what}: `{cmd[0]}` is not installed or not on PATH; install the Slurm client "
                "(scripts/install-slurm.sh on Debian) or fix PATH", cmd=cmd) from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(
                f"{what}: `{' '.join(cmd)}` did not answer within {exc.timeout:.0f} s; {_STATUS_HINT}",
                cmd=cmd) from exc
        if result.returncode != 0:
            message = (result.stderr or result.stdout or "").strip() or f"exit code {result.returncode}"
            raise SlurmError(f"{what} failed: {message} (ran: {' '.join(cmd)}); {hint}",
                             cmd=cmd, returncode=result.returncode, stderr=result.stderr or "")
        return result.stdout

    def _paced(self, cmd: Sequence[str], took: float) -> None:
        """Slow down the routine reads while slurmctld answers slowly, and say so; back to normal once it
        answers promptly. Under Slurm's RPC rate limit a command does not fail: it waits and asks again."""
        if took > SLOW_ANSWER_S and self.backoff < MAX_BACKOFF:
            self.backoff *= 2
            self.say(f"slurmctld took {took:.1f} s to answer `{' '.join(cmd[:2])}` (Slurm's RPC rate limit, "
                     f"rl_enable, or a busy controller): training goes on; the launcher now reads the cluster "
                     f"{self.backoff}x less often")
        elif took < SLOW_ANSWER_S / 3 and self.backoff > 1:
            self.backoff = 1
            self.say("slurmctld answers promptly again: the launcher reads the cluster as often as before")

    # ----------------------------------------------------------- queries
    def job_info(self, job_id: int) -> JobInfo:
        out = self._run(build_show_job_command(job_id), f"reading job {job_id}",
                        "check the job id with `squeue`; finished jobs vanish after MinJobAge")
        return parse_scontrol_show_job(out)

    def allocation(self, job_id: int) -> Allocation:
        """What job `job_id` (a heterogeneous job's leader, or a plain job) holds: every component,
        its nodes and the GPUs on each."""
        return parse_show_job_detail(self._run(build_show_job_command(job_id, detail=True), f"reading job {job_id}",
                                               "check the job id with `squeue`; finished jobs vanish after MinJobAge"))

    def jobs(self, max_age: float = 0.0) -> list[JobInfo]:
        """Every job; like `nodes`, a read at most `max_age` s old (times the back-off) is answered again."""
        return self._shared("jobs", max_age, lambda: parse_squeue_json(
            self._run(build_squeue_command(fmt=self.json_format()), "listing jobs", _STATUS_HINT)))

    def nodes(self, max_age: float = 0.0) -> list[NodeInfo]:
        """Every node; a read at most `max_age` seconds old is answered again without asking slurmctld (the
        routine looks -- node health, drains, the policy's partition -- share one read: two RPCs, node and
        partition info, whatever asks)."""
        return self._shared("nodes", max_age, lambda: parse_sinfo_json(
            self._run(build_sinfo_command(self.json_format()), "listing nodes", _STATUS_HINT)))

    def _shared(self, what: str, max_age: float, read: Callable[[], list]) -> list:
        """The last read of `what` while it is at most `max_age` s old (times the back-off), else a new one."""
        now = time.monotonic()
        last = self._reads.get(what)
        if last is None or now - last[0] > max_age * self.backoff:
            last = self._reads[what] = (now, read())
        return list(last[1])

    def admin_level(self, user: str) -> str:
        """`user`'s AdminLevel in Slurm's accounting (None, Operator, Administrator); "" for a user it lacks.
        SlurmError where sacctmgr cannot answer (no slurmdbd)."""
        return self._run(build_admin_level_command(user), f"reading {user}'s AdminLevel",
                         "Slurm's accounting (slurmdbd) must answer sacctmgr").strip()

    def release(self) -> tuple[int, int]:
        """The tools' Slurm release, read once (`version`)."""
        if self._release is None:
            self._release = self.version()
        return self._release

    def json_format(self) -> str | None:
        """The JSON format to ask squeue and sinfo for, on this release (slurm_json.json_format)."""
        return json_format(self.release())

    def node_states(self, nodes: Sequence[str], max_age: float = 0.0) -> dict[str, tuple[str, bool]]:
        """node -> (state, answering) of `nodes` (slurm.parse.parse_node_states); with `max_age`, from the
        shared read of every node (`nodes`) where that is fresh enough, else asked now."""
        if max_age > 0:
            known = {n.name: n for n in self.nodes(max_age)}
            if all(n in known for n in nodes):
                return {n: node_state_words(known[n]) for n in nodes}
        return parse_node_states(self._run(build_node_states_command(nodes), "reading node states", _STATUS_HINT))

    def probe_node(self, job_id: int, node: str, timeout: float, het_group: int | None = None,
                   gpus: int = 0) -> str | None:
        """Run one task (`true`, asking for `gpus` GPUs) in job `job_id` on `node`; None when it ran, else
        what went wrong. A node whose slurmd is gone fails the step's launch, or does not answer in `timeout` s."""
        cmd = build_srun_command(job_id, [node], 1, gpus, {}, ["true"], het_group=het_group, gres_none=not gpus)
        try:
            result = self.runner(cmd, input=None, env=self._env(), timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"a one-task step on it did not end within {timeout:.0f} s"
        if result.returncode == 0:
            return None
        lines = [ln for ln in (result.stderr or "").splitlines() if ln.strip()]
        return f"a one-task step on it failed ({lines[-1].strip() if lines else f'exit {result.returncode}'})"

    def no_kill(self, job_id: int) -> bool | None:
        """Whether Slurm keeps job `job_id` running when one of its nodes fails (parse.submitted_no_kill);
        None when that cannot be read (no accounting, the script not readable)."""
        found: list[str | None] = []
        for cmd in (build_submit_line_command(job_id), build_batch_script_command(job_id)):
            try:
                found.append(self._run(cmd, f"reading how job {job_id} was submitted", _STATUS_HINT).strip() or None)
            except SlurmError:
                found.append(None)
        return submitted_no_kill(found[0], found[1], os.environ)

    def batch_script(self, job_id: int) -> str:
        """Job `job_id`'s batch script as Slurm keeps it (`scontrol write batch_script`)."""
        return self._run(build_batch_script_command(job_id), f"reading job {job_id}'s batch script", _STATUS_HINT)

    def version(self) -> tuple[int, int]:
        """The cluster tools' Slurm major.minor, e.g. (22, 5)."""
        return parse_slurm_version(self._run(["scontrol", "--version"], "reading the Slurm version",
                                             "install the Slurm client tools"))

    # ----------------------------------------------------------- changes
    def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        """Release every node of the job not in keep_nodes.

        Tasks of running steps on released nodes are SIGKILLed at once, with
        no SIGTERM: move their state away before calling this.
        """
        cmd = build_shrink_command(job_id, keep_nodes)
        hint = ("keep_nodes must be a non-empty subset of the job's current nodes that includes "
                "its batch host; see `scontrol show job " f"{job_id}`")
        try:
            self._run(cmd, f"shrinking job {job_id} to {compress_hostlist(keep_nodes)}", hint)
        except SlurmError as exc:
            raise SlurmError(f"{exc}{self._shrink_diagnosis(job_id, keep_nodes)}", cmd=exc.cmd,
                             returncode=exc.returncode, stderr=exc.stderr) from exc

    def _shrink_diagnosis(self, job_id: int, keep_nodes: Sequence[str]) -> str:
        """Slurm's message ('Invalid node name specified') rarely says why; look."""
        try:
            info = self.job_info(job_id)
        except SlurmError:
            return ""
        problems = []
        if info.batch_host and info.batch_host not in keep_nodes:
            problems.append(f"the batch host {info.batch_host} is not kept (it can never be released)")
        outside = [n for n in keep_nodes if n not in info.nodes]
        if outside:
            problems.append(f"{compress_hostlist(outside)} not in the job's nodes "
                            f"{compress_hostlist(info.nodes) or '(none)'}")
        return (" [diagnosis: " + "; ".join(problems) + "]") if problems else ""

    def submit(self, script: str | Path, env: Mapping[str, str] | None = None,
               extra_args: Sequence[str] = ()) -> int:
        """Submit a batch job; `script` is a path or the script text itself."""
        is_path = isinstance(script, Path) or (not script.startswith("#!") and "\n" not in script)
        cmd = build_sbatch_command(script if is_path else None, extra_args)
        out = self._run(cmd, "submitting a batch job",
                        "check the #SBATCH options against `sinfo` (nodes, gres) and the script path",
                        input=None if is_path else str(script), env=env)
        return parse_sbatch_output(out)

    def cancel(self, job_id: int) -> None:
        self._run(build_cancel_command(job_id), f"cancelling job {job_id}",
                  "check the job id with `squeue`")

    def hold(self, job_id: int, seconds: int) -> None:
        """Keep pending job `job_id` from starting for `seconds` more (its StartTime)."""
        self._run(build_hold_command(job_id, seconds), f"holding job {job_id}", "the job must be pending; check it "
                  "with `squeue`")

    def set_comment(self, job_id: int, comment: str) -> None:
        self._run(build_comment_command(job_id, comment), f"marking job {job_id}",
                  "the job must be yours and not finished; check it with `squeue`")

    def signal(self, job_id: int, sig: int | str, batch: bool = False) -> None:
        """Signal the job's steps, or with batch=True its batch shell."""
        self._run(build_signal_command(job_id, sig, batch), f"sending {signal_name(sig)} to job {job_id}",
                  "the job must be running; check it with `squeue`")

    def signal_step_on(self, job_id: int, node: str, sig: int | str) -> str | None:
        """Send `sig` to the tasks of job `job_id`'s worker step on `node` through slurmctld (`scancel
        --signal=SIG JOB.STEP`); returns the step, or None when no such step is listed yet.

        Why not signal srun: srun forwards only some signals; on SIGTERM, SIGHUP or SIGQUIT it forces
        the step's termination and the tasks get SIGKILL (measured on the testbed: a task's SIGTERM
        handler never ran), which breaks torchrun's contract of SIGTERM first.

        Slurm 22.05's scancel exits 225 "Invalid job id specified" for a step on some nodes of a job
        (measured: a step on n2 of a job on n1,n2) although the tasks got the signal: that answer counts
        as delivered."""
        step = parse_step_on_node(self._run(build_steps_command(job_id), f"listing the steps of job {job_id}",
                                            _STATUS_HINT), node)
        if step is not None:
            try:
                self._run(build_signal_command(step, sig), f"sending {signal_name(sig)} to step {step}",
                          "the step must be running; check it with `squeue --steps`")
            except SlurmError as exc:
                if "Invalid job id specified" not in exc.stderr:
                    raise
        return step

    def start_step(self, job_id: int, nodes: Sequence[str], ntasks_per_node: int,
                   gpus_per_node: int, env: Mapping[str, str], argv: Sequence[str],
                   overlap: bool = True, other_job: bool = False, het_group: int | None = None,
                   gpus_per_step: bool = False, gres_none: bool = False, **popen_kwargs: Any) -> subprocess.Popen:
        """Start `srun` for one step and return at once; the caller owns the process.

        other_job=True: the step belongs to another job than the one this process runs in (a
        companion job), so srun gets none of this job's SLURM_* variables (SLURM_CONF stays).
        het_group: the component of a heterogeneous job (`job_id` is then the leader's)."""
        cmd = build_srun_command(job_id, nodes, ntasks_per_node, gpus_per_node, env, argv, overlap, het_group,
                                 gpus_per_step, gres_none)
        popen_kwargs.setdefault("env", env_outside_job(self._env()) if other_job else self._env())
        try:
            return subprocess.Popen(cmd, **popen_kwargs)
        except FileNotFoundError as exc:
            raise SlurmError("starting a step: `srun` is not installed or not on PATH; install the "
                             "Slurm client (scripts/install-slurm.sh) or fix PATH", cmd=cmd) from exc


