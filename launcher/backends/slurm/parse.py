"""Reading what Slurm prints: `scontrol show job`, `squeue --json`, `sinfo --json`, `sbatch --parsable`,
srun's error lines, into plain records.

Pure (text in, records out), so the parsers are tested on output captured from a real slurmctld
and the dashboard may use them without running anything of the launcher.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from collections.abc import Mapping

from launcher.backends.slurm.hostlist import expand_hostlist
from launcher.backends.slurm.slurm_json import job_records, node_records

#: Job states in which a job holds its nodes and their GPUs, for the launcher (which nodes a job or
#: component can run on) and the dashboard (which GPUs are taken) alike: an ended job or component
#: still shows its old node list, a pending one has none. CONFIGURING (nodes allocated, still booting)
#: and STOPPED (execution stopped by SIGSTOP, resources retained) hold them as much as RUNNING does.
HOLDING_STATES = ("RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "STOPPED")


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
    comment: str = field(default="", compare=False)  # where elastic jobs mark themselves (launcher.policy.peers)
    priority: int = field(default=0, compare=False)
    submit_time: int = field(default=0, compare=False)
    user_id: int | None = field(default=None, compare=False)  # the owner's uid (`UserId=alice(1001)`)


@dataclass(frozen=True)
class NodeInfo:
    """One node as `sinfo --json` reports it."""

    name: str
    state: str
    cpus: int
    gres: str
    partitions: list[str] = field(default_factory=list)
    flags: tuple[str, ...] = field(default=(), compare=False)  # state flags: RESERVED, DRAIN, PLANNED, ...



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




# ------------------------------------------------------------------ parsers
def parse_scontrol_show_job(text: str) -> JobInfo:
    """Parse `scontrol show job` output (multi-line or `-o`) into JobInfo."""
    fields = parse_key_values(text)
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
        user_id=_uid(fields.get("UserId", "")),
    )


def _uid(user_id: str) -> int | None:
    """1001 of scontrol's `alice(1001)`; None when it is not there."""
    found = re.search(r"\((\d+)\)$", user_id)
    return int(found.group(1)) if found else None


def parse_key_values(text: str) -> dict[str, str]:
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
    """`squeue --json` of any release (launcher.backends.slurm.slurm_json) into JobInfo records."""
    return [
        JobInfo(job_id=job.job_id, state=job.state, nodes=expand_hostlist(job.nodes), batch_host=job.batch_host or None,
                num_nodes=job.node_count, name=job.name, reason=job.reason, partition=job.partition,
                comment=job.comment, priority=job.priority, submit_time=job.submit_time)
        for job in job_records(text)
    ]


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    """`sinfo --json` of any release (launcher.backends.slurm.slurm_json) into NodeInfo records."""
    return [NodeInfo(name=n.name, state=n.state, cpus=n.cpus, gres=n.gres, partitions=list(n.partitions),
                     flags=n.flags) for n in node_records(text)]


#: node states (sinfo's extended form, lower case, flags stripped) of a node the job can no longer use
GONE_STATES = ("down", "fail", "failing", "unknown", "future", "power_down", "powered_down", "powering_down")


def node_state_words(node: NodeInfo) -> tuple[str, bool]:
    """(state, answering) of a node read from `sinfo --json` in the words parse_node_states gives (sinfo's
    %T: drained, draining, fail, powered_down, ...), so one read of every node can answer both."""
    flags, state = set(node.flags), node.state
    if "POWERED_DOWN" in flags or "POWERING_DOWN" in flags:
        state = "powered_down" if "POWERED_DOWN" in flags else "powering_down"
    elif "FAIL" in flags:
        state = "failing" if state in ("allocated", "mixed", "completing") else "fail"
    elif "DRAIN" in flags and state != "down":
        state = "draining" if state in ("allocated", "mixed", "completing") else "drained"
    return state, "NOT_RESPONDING" not in flags


def parse_node_states(text: str) -> dict[str, tuple[str, bool]]:
    """`sinfo --Node --format="%N %T"` -> node -> (state, answering). A node listed in several partitions
    appears once; `*` after the state means slurmctld's pings go unanswered."""
    states: dict[str, tuple[str, bool]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            state = parts[1].lower()
            states[parts[0]] = (state.rstrip("*~#!%$@^-"), not state.endswith("*"))
    return states


def submitted_no_kill(submit_line: str | None, script: str | None, env: Mapping[str, str]) -> bool | None:
    """Whether a job was submitted with `--no-kill` (`-k`; `--no-kill=off` is the opposite), from what Slurm
    22.05 keeps of it -- it shows the flag nowhere else: the sbatch command line (sacct's SubmitLine), the
    batch script's #SBATCH lines, and SBATCH_NO_KILL in the submission environment the batch step inherits.
    None when neither the command line nor the script could be read."""
    if "SBATCH_NO_KILL" in env:
        return env["SBATCH_NO_KILL"].lower() != "off"
    if submit_line is None and script is None:
        return None
    words = (submit_line or "").split()
    for line in (script or "").splitlines():
        if line.startswith("#SBATCH"):
            words += line[len("#SBATCH"):].split()
    found = [w for w in words if w in ("-k", "--no-kill") or w.startswith("--no-kill=")]
    return bool(found) and found[-1].lower() != "--no-kill=off"


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


_SDIAG_RPC = re.compile(r"^\s*(?P<type>[A-Z][A-Z0-9_]+)\s*\(\s*\d+\)\s*count:(?P<count>\d+)")


def parse_sdiag_rpcs(text: str) -> dict[str, int]:
    """`sdiag`'s "Remote Procedure Call statistics by message type" -> message type -> count (every release
    prints `TYPE ( NUMBER) count:N ...`)."""
    counts: dict[str, int] = {}
    section = False
    for line in text.splitlines():
        if "statistics by message type" in line:
            section = True
        elif "statistics by user" in line or "Pending RPC statistics" in line:
            section = False
        elif section and (m := _SDIAG_RPC.match(line)):
            counts[m["type"]] = int(m["count"])
    return counts


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

