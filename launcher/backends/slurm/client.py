"""Talking to Slurm: pure command builders and parsers, and the client that runs them.

One client interface (`SlurmBackend`), two implementations: the Slurm command-line tools
(`SlurmCommands`, here) work against any cluster, while pyslurm is faster but must be built for
the cluster's exact Slurm major.minor (PyPI only has 25.11, Debian 12 ships 22.05). So
`SlurmCommands` is the default and `launcher.backends.slurm.pyslurm.PyslurmBackend` is picked only
when a matching pyslurm imports (`select_backend`).

Command *building* is pure (functions returning argv lists, checked against
golden files) and kept apart from *running* (a `Runner` that can be replaced
in tests), the way submitit builds its sbatch/srun lines. Parsers take the
text Slurm prints, so they are tested on outputs captured from a real
slurmctld.
"""
from __future__ import annotations

import json
import os
import re
import signal as signal_module
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

DEFAULT_TIMEOUT_S = 30.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
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


@dataclass(frozen=True)
class JobInfo:
    """What the launcher needs to know about one job (from `scontrol show job`)."""

    job_id: int
    state: str
    nodes: list[str]
    batch_host: str | None
    num_nodes: int
    name: str = ""
    reason: str = ""
    partition: str = field(default="", compare=False)  # not compared: older records and goldens lack it


@dataclass(frozen=True)
class NodeInfo:
    """One node as `sinfo --json` reports it."""

    name: str
    state: str
    cpus: int
    gres: str
    partitions: list[str] = field(default_factory=list)


# --------------------------------------------------------------- hostlists
_HOST_RANGE = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<body>[^\[\]]+)\](?P<suffix>[^\[\]]*)$")


def expand_hostlist(expr: str) -> list[str]:
    """`n[1-3,5],gpu01` -> ['n1', 'n2', 'n3', 'n5', 'gpu01'] (zero padding kept).

    Handles one bracket group per host pattern, which is what Slurm prints.
    """
    expr = expr.strip()
    if not expr or expr == "(null)":
        return []
    hosts: list[str] = []
    for item in _split_top_level(expr):
        match = _HOST_RANGE.match(item)
        if not match:
            if "[" in item or "]" in item:
                raise ValueError(f"cannot expand host list {expr!r}: bad item {item!r}")
            hosts.append(item)
            continue
        prefix, suffix = match["prefix"], match["suffix"]
        for part in match["body"].split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"cannot expand host list {expr!r}: bad range {part!r}")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def _split_top_level(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, current = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    items.append("".join(current))
    return [i for i in items if i]


_HOST_NUMBER = re.compile(r"^(?P<prefix>.*?)(?P<num>\d+)$")


def compress_hostlist(nodes: Iterable[str]) -> str:
    """['n1', 'n2', 'n3', 'n5'] -> 'n[1-3,5]'; prefixes in order of first appearance.

    A single host stays bare (`n1`, not `n[1]`) so commands read naturally.
    Zero padding is kept: ['gpu08', 'gpu09', 'gpu10'] -> 'gpu[08-10]'.
    """
    numbers: dict[str, list[int]] = {}
    widths: dict[str, int] = {}
    order: list[tuple[str, str]] = []  # ("bare", host) or ("group", prefix)
    for node in nodes:
        match = _HOST_NUMBER.match(node)
        if not match:
            if ("bare", node) not in order:
                order.append(("bare", node))
            continue
        prefix, digits = match["prefix"], match["num"]
        if prefix not in numbers:
            numbers[prefix], widths[prefix] = [], 0
            order.append(("group", prefix))
        if digits.startswith("0") and len(digits) > 1:
            widths[prefix] = max(widths[prefix], len(digits))
        if int(digits) not in numbers[prefix]:
            numbers[prefix].append(int(digits))
    return ",".join(
        item if kind == "bare" else _compress_group(item, widths[item], sorted(numbers[item]))
        for kind, item in order
    )


def _compress_group(prefix: str, width: int, numbers: list[int]) -> str:
    fmt = (lambda n: f"{n:0{width}d}") if width else str
    if len(numbers) == 1:
        return f"{prefix}{fmt(numbers[0])}"
    ranges, start, prev = [], numbers[0], numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        ranges.append(fmt(start) if start == prev else f"{fmt(start)}-{fmt(prev)}")
        if n is not None:
            start = prev = n
    return f"{prefix}[{','.join(ranges)}]"


# -------------------------------------------------------- command builders
def build_srun_command(job_id: int | str, nodes: Sequence[str], ntasks_per_node: int,
                       gpus_per_node: int, env: Mapping[str, str], argv: Sequence[str],
                       overlap: bool = True, het_group: int | None = None, gpus_per_step: bool = False) -> list[str]:
    """srun line for one step on chosen nodes of a running job.

    GPUs: `--gres=gpu:G` per node; `gpus_per_step=True` asks `--gpus=<G x nodes>` instead, for a
    plain job whose nodes hold different GPU counts (`sbatch --gpus=N` or `--exclusive` on uneven
    nodes): Slurm 22.05 refuses `--gres=gpu:G` (and `--gpus-per-node=G`) steps there when G is above
    the job's smallest per-node share ("Step requested gres_per_node=gpu:4 is more than the job's
    gres_per_node=gpu:2"), while a one-node step with `--gpus=4` gets the node's 4.

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
    if gpus_per_node:
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


def build_squeue_command(job_ids: Sequence[int | str] = ()) -> list[str]:
    """`squeue --json`, optionally limited to some jobs."""
    cmd = ["squeue", "--json"]
    if job_ids:
        cmd.append(f"--jobs={','.join(str(j) for j in job_ids)}")
    return cmd


def build_sinfo_command() -> list[str]:
    return ["sinfo", "--json"]


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
                         exclude: Sequence[str] = (), output: str | Path | None = None) -> list[str]:
    """sbatch options of a companion job: `nodes` more whole nodes for a running elastic job.

    Slurm 22.05 cannot grow a job that holds GRES (`--dependency=expand` fails with "has
    allocated GRES") and never gives a job its released nodes back, so the launcher asks for
    the extra nodes as a second batch job in the same partition, with the same GPUs and tasks
    per node, and starts the workers on them as steps of that job. `exclude` keeps the
    companion off nodes the job already holds (the scheduler would otherwise pack it onto their
    free cores). `--no-requeue`: a companion that lost a node must not come back on its own.
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
    args.append("--no-requeue")
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
                            exclude: Sequence[str] = (), output: str | Path | None = None) -> list[str]:
    """The full sbatch line of a companion job (its script, build_companion_script, goes on stdin)."""
    return build_sbatch_command(None, build_companion_args(job_name, n, nodes, gpus_per_node, partition,
                                                           exclude, output))


def build_cancel_command(job_id: int | str) -> list[str]:
    return ["scancel", str(job_id)]


def build_signal_command(job_id: int | str, sig: int | str, batch: bool = False) -> list[str]:
    """`scancel --signal=SIG [--batch] JOB`: steps only by default, the batch shell with batch=True."""
    cmd = ["scancel", f"--signal={_signal_name(sig)}"]
    if batch:
        cmd.append("--batch")
    return cmd + [str(job_id)]


def build_steps_command(job_id: int | str) -> list[str]:
    """`squeue --steps` of one job: one `STEPID NODELIST` line per step (batch and extern included)."""
    return ["squeue", "--steps", f"--jobs={job_id}", "--noheader", "--format=%i %N"]


def parse_step_on_node(text: str, node: str) -> str | None:
    """The newest worker step (`JOB.N`, N a number: not the batch or extern step) whose nodes include
    `node`, from build_steps_command's output; None when there is none (not started yet, or ended)."""
    best: tuple[int, str] | None = None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or "." not in parts[0]:
            continue
        step = parts[0].rpartition(".")[2]
        if step.isdigit() and node in expand_hostlist(parts[1]) and (best is None or int(step) > best[0]):
            best = (int(step), parts[0])
    return best[1] if best else None


def _signal_name(sig: int | str) -> str:
    """Signal.SIGUSR1, 10, 'USR1' and 'SIGUSR1' all become 'USR1' (scancel's spelling)."""
    if isinstance(sig, str):
        name = sig.upper()
        return name[3:] if name.startswith("SIG") else name
    return signal_module.Signals(sig).name[3:]


# ------------------------------------------------------------------ parsers
def parse_scontrol_show_job(text: str) -> JobInfo:
    """Parse `scontrol show job` output (multi-line or `-o`) into JobInfo."""
    fields = _parse_key_values(text)
    if "JobId" not in fields:
        raise ValueError(f"no JobId in scontrol output: {text[:200]!r}")
    batch_host = fields.get("BatchHost") or None
    return JobInfo(
        job_id=int(fields["JobId"]),
        state=fields.get("JobState", "UNKNOWN"),
        nodes=expand_hostlist(fields.get("NodeList", "")),
        batch_host=None if batch_host in (None, "(null)") else batch_host,
        num_nodes=_leading_int(fields.get("NumNodes", "0")),
        name=fields.get("JobName", ""),
        reason=fields.get("Reason", ""),
        partition=fields.get("Partition", ""),
    )


def _parse_key_values(text: str) -> dict[str, str]:
    """Whitespace-separated Key=Value tokens; tokens without '=' continue the previous
    value (e.g. a Command with arguments). First record only, first value wins."""
    fields: dict[str, str] = {}
    last_key: str | None = None
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key and re.match(r"^[A-Za-z][\w/:]*$", key):
            if key == "JobId" and "JobId" in fields:
                break  # a second job record
            if key not in fields:
                fields[key] = value
                last_key = key
            else:
                last_key = None
        elif last_key is not None:
            fields[last_key] += " " + token
    return fields


def _leading_int(text: str) -> int:
    """'2' -> 2, '2-4' -> 2 (pending jobs show a range)."""
    match = re.match(r"\d+", text)
    return int(match.group()) if match else 0


def parse_squeue_json(text: str) -> list[JobInfo]:
    """Parse `squeue --json` (22.05 layout: {"jobs": [...]}) into JobInfo records."""
    data = _load_json(text, "squeue --json")
    jobs = []
    for job in data.get("jobs", []):
        batch_host = job.get("batch_host") or None
        jobs.append(JobInfo(
            job_id=int(job["job_id"]),
            state=_state_str(job.get("job_state", "UNKNOWN")),
            nodes=expand_hostlist(job.get("nodes") or ""),
            batch_host=batch_host,
            num_nodes=int(job.get("node_count") or 0),
            name=job.get("name", ""),
            reason=job.get("state_reason", ""),
            partition=job.get("partition", "") or "",
        ))
    return jobs


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    """Parse `sinfo --json` (22.05 layout: {"nodes": [...]}) into NodeInfo records."""
    data = _load_json(text, "sinfo --json")
    return [
        NodeInfo(
            name=node["name"],
            state=_state_str(node.get("state", "unknown")).lower(),
            cpus=int(node.get("cpus") or 0),
            gres=node.get("gres") or "",
            partitions=list(node.get("partitions") or []),
        )
        for node in data.get("nodes", [])
    ]


def _state_str(state: Any) -> str:
    """22.05 prints states as strings, newer Slurm as lists of flags: accept both."""
    if isinstance(state, list):
        return state[0] if state else "UNKNOWN"
    return str(state)


def _load_json(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"`{what}` did not print JSON ({exc}); output starts {text[:200]!r}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"`{what}` printed JSON that is not an object")
    return data


_TASK_END = re.compile(r"^srun: error: (?P<node>[^:\s]+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+?)\s*$")
_TASK_SIGNALS = {"Killed": 137, "Terminated": 143, "Aborted": 134, "Segmentation fault": 139}


def parse_task_end(line: str) -> tuple[str, list[int], int] | None:
    """srun's line about step tasks that ended badly, e.g. `srun: error: n1: task 0: Killed` or
    `srun: error: n2: tasks 0-1: Exited with exit code 3`: (node, task ids, exit status), else None.
    srun prints it at once, while the step's other tasks run on (--kill-on-bad-exit=0)."""
    match = _TASK_END.match(line)
    if not match:
        return None
    tasks: list[int] = []
    for part in match["tasks"].split(","):
        lo, _, hi = part.partition("-")
        tasks += range(int(lo), int(hi or lo) + 1)
    what = match["what"]
    code = re.match(r"Exited with exit code (\d+)", what)
    return match["node"], tasks, int(code.group(1)) if code else next(
        (status for name, status in _TASK_SIGNALS.items() if what.startswith(name)), 1)


def parse_sbatch_output(text: str) -> int:
    """`sbatch --parsable` prints `JOBID` or `JOBID;CLUSTER`."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    job_id = first.split(";")[0]
    if not job_id.isdigit():
        raise ValueError(f"sbatch --parsable printed {text.strip()!r}, expected a job id")
    return int(job_id)


def parse_slurm_version(text: str) -> tuple[int, int]:
    """'slurm-wlm 22.05.8' / 'slurm 22.05.8' -> (22, 5); also pyslurm's '22.5.1'."""
    match = re.search(r"(\d+)\.(\d+)", text)
    if not match:
        raise ValueError(f"no version number in {text!r}")
    return int(match.group(1)), int(match.group(2))


# ------------------------------------------------------------------ running
Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def subprocess_runner(cmd: Sequence[str], *, input: str | None = None,
                      env: Mapping[str, str] | None = None,
                      timeout: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """The real runner: capture text output, never raise on a non-zero exit."""
    return subprocess.run(list(cmd), input=input, env=dict(env) if env is not None else None,
                          capture_output=True, text=True, timeout=timeout, check=False)


@runtime_checkable
class SlurmBackend(Protocol):
    """What the launcher asks of Slurm. Both backends implement it."""

    def job_info(self, job_id: int) -> JobInfo: ...

    def jobs(self) -> list[JobInfo]: ...

    def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None: ...

    def submit(self, script: str | Path, env: Mapping[str, str] | None = None,
               extra_args: Sequence[str] = ()) -> int: ...

    def cancel(self, job_id: int) -> None: ...

    def signal(self, job_id: int, sig: int | str, batch: bool = False) -> None: ...

    def signal_step_on(self, job_id: int, node: str, sig: int | str) -> str | None: ...

    def nodes(self) -> list[NodeInfo]: ...

    def start_step(self, job_id: int, nodes: Sequence[str], ntasks_per_node: int,
                   gpus_per_node: int, env: Mapping[str, str], argv: Sequence[str],
                   overlap: bool = True, other_job: bool = False, het_group: int | None = None,
                   gpus_per_step: bool = False, **popen_kwargs: Any) -> subprocess.Popen: ...


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

    def _env(self, more: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(more or {})
        return env

    def _run(self, cmd: list[str], what: str, hint: str, *, input: str | None = None,
             env: Mapping[str, str] | None = None) -> str:
        """Run one command; turn every failure into a SlurmError that says what to do."""
        try:
            result = self.runner(cmd, input=input, env=self._env(env), timeout=self.timeout)
        except FileNotFoundError as exc:
            raise SlurmError(
                f"{what}: `{cmd[0]}` is not installed or not on PATH; install the Slurm client "
                "(scripts/install-slurm.sh on Debian) or fix PATH", cmd=cmd) from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(
                f"{what}: `{' '.join(cmd)}` did not answer within {self.timeout:.0f} s; {_STATUS_HINT}",
                cmd=cmd) from exc
        if result.returncode != 0:
            message = (result.stderr or result.stdout or "").strip() or f"exit code {result.returncode}"
            raise SlurmError(f"{what} failed: {message} (ran: {' '.join(cmd)}); {hint}",
                             cmd=cmd, returncode=result.returncode, stderr=result.stderr or "")
        return result.stdout

    # ----------------------------------------------------------- queries
    def job_info(self, job_id: int) -> JobInfo:
        out = self._run(build_show_job_command(job_id), f"reading job {job_id}",
                        "check the job id with `squeue`; finished jobs vanish after MinJobAge")
        return parse_scontrol_show_job(out)

    def allocation(self, job_id: int):
        """What job `job_id` (a heterogeneous job's leader, or a plain job) holds: every component,
        its nodes and the GPUs on each (launcher.backends.slurm.allocation.Allocation)."""
        from launcher.backends.slurm.allocation import parse_show_job_detail  # it builds on this module's parsers

        return parse_show_job_detail(self._run(build_show_job_command(job_id, detail=True), f"reading job {job_id}",
                                               "check the job id with `squeue`; finished jobs vanish after MinJobAge"))

    def jobs(self) -> list[JobInfo]:
        return parse_squeue_json(self._run(build_squeue_command(), "listing jobs", _STATUS_HINT))

    def nodes(self) -> list[NodeInfo]:
        return parse_sinfo_json(self._run(build_sinfo_command(), "listing nodes", _STATUS_HINT))

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

    def signal(self, job_id: int, sig: int | str, batch: bool = False) -> None:
        """Signal the job's steps, or with batch=True its batch shell."""
        self._run(build_signal_command(job_id, sig, batch), f"sending {_signal_name(sig)} to job {job_id}",
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
                self._run(build_signal_command(step, sig), f"sending {_signal_name(sig)} to step {step}",
                          "the step must be running; check it with `squeue --steps`")
            except SlurmError as exc:
                if "Invalid job id specified" not in exc.stderr:
                    raise
        return step

    def start_step(self, job_id: int, nodes: Sequence[str], ntasks_per_node: int,
                   gpus_per_node: int, env: Mapping[str, str], argv: Sequence[str],
                   overlap: bool = True, other_job: bool = False, het_group: int | None = None,
                   gpus_per_step: bool = False, **popen_kwargs: Any) -> subprocess.Popen:
        """Start `srun` for one step and return at once; the caller owns the process.

        other_job=True: the step belongs to another job than the one this process runs in (a
        companion job), so srun gets none of this job's SLURM_* variables (SLURM_CONF stays).
        het_group: the component of a heterogeneous job (`job_id` is then the leader's)."""
        cmd = build_srun_command(job_id, nodes, ntasks_per_node, gpus_per_node, env, argv, overlap, het_group,
                                 gpus_per_step)
        popen_kwargs.setdefault("env", env_outside_job(self._env()) if other_job else self._env())
        try:
            return subprocess.Popen(cmd, **popen_kwargs)
        except FileNotFoundError as exc:
            raise SlurmError("starting a step: `srun` is not installed or not on PATH; install the "
                             "Slurm client (scripts/install-slurm.sh) or fix PATH", cmd=cmd) from exc


def select_backend(env: Mapping[str, str] | None = None, runner: Runner | None = None,
                   importer: Callable[[str], Any] | None = None) -> SlurmBackend:
    """PyslurmBackend if pyslurm imports and matches the cluster's Slurm major.minor,
    else SlurmCommands. A mismatched pyslurm would speak the wrong RPC protocol."""
    commands = SlurmCommands(env=env, runner=runner)
    try:
        pyslurm = (importer or __import__)("pyslurm")
        lib_version = parse_slurm_version(str(getattr(pyslurm, "__version__", "")))
        cluster_version = commands.version()
    except (ImportError, ValueError, SlurmError):
        return commands
    if lib_version != cluster_version:
        return commands
    from launcher.backends.slurm.pyslurm import PyslurmBackend

    return PyslurmBackend(pyslurm, env=env, runner=runner)
