"""The one validation of admin requests (preempt, shrink, grow, suspend, resume), used by the CLI,
the dashboard and the launcher, so a request means the same thing whichever door it came through.

`validate_request` is pure: it sees the job, the nodes it holds and the requests still pending, and
returns normalised params or raises ValueError with a one-line reason. It refuses requests for jobs
that are not in the state the action needs (nothing is queued for a finished or failed job),
preempting every node, going below the job's MIN (`Job.min_nodes`, from --nnodes; never clamped),
above its most nodes, and a request identical to one still pending.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

from db.records import AdminRequest, Job
from db.vocab import MAX_NAME, POLICIES, REQUEST_ACTIONS



class Store(Protocol):
    """What the checks read from db.store.Store (named here so this module, which the store imports, does
    not import it back)."""

    def current_rank_map(self, job_id: int) -> Any: ...

    def pending_requests(self, job_id: int) -> list[AdminRequest]: ...

#: the job state each action needs
NEEDS_STATE = {"preempt": "running", "shrink": "running", "grow": "running", "suspend": "running",
               "resume": "suspended"}


def _whole(name: str, value: Any) -> int:
    """A whole number from an int or ASCII digits (form fields arrive as text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = value.strip() if isinstance(value, str) else ""
    if not (text.isascii() and text.isdigit() and len(text) <= 6):
        raise ValueError(f"{name} must be a whole number, not {str(value)[:40]!r}")
    return int(text)


def _node_names(value: Any) -> list[str]:
    """Node names from a list or a comma-separated text, de-duplicated in order."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    names = list(dict.fromkeys(str(n).strip() for n in items if str(n).strip()))
    if any(len(n) > MAX_NAME for n in names):
        raise ValueError(f"node names are at most {MAX_NAME} characters")
    return names


def most_nodes(job: Job) -> int:
    """The most nodes the job may use: its --nnodes MAX as recorded (v9), else (older rows) its max
    devices over GPUs per node, rounded up (which undercounts uneven nodes)."""
    return job.max_nodes or -(-job.max_devices // job.gpus_per_node)


def _preempt(job: Job, held: Sequence[str], raw: Mapping[str, Any]) -> dict[str, Any]:
    floor = max(job.min_nodes, 1)
    names = _node_names(raw.get("nodes"))
    if names:
        bad = [n for n in names if n not in held]
        if bad:
            raise ValueError(f"job {job.name} does not hold {', '.join(bad)}; it holds {', '.join(held) or 'no nodes'}")
        if job.pinned_node in names:
            raise ValueError(f"{job.pinned_node} is the job's pinned node (it runs the batch step) and cannot be "
                             "preempted")
        left = len(held) - len(names)
        if left < floor:
            what = "every node the job holds" if left == 0 else f"down to {left} node{'s' * (left != 1)}"
            raise ValueError(f"cannot preempt {what}: job {job.name} needs at least {floor} (MIN)")
        return {"nodes": names}
    if raw.get("count") in (None, ""):
        raise ValueError("preempt needs nodes (e.g. n3,n4) or a count")
    count, most = _whole("count", raw["count"]), len(held) - floor
    if most < 1:
        raise ValueError(f"job {job.name} holds {len(held)} node(s) and needs at least {floor} (MIN): none can go")
    if not 1 <= count <= most:
        raise ValueError(f"count must be 1..{most}: job {job.name} holds {len(held)} nodes and needs at least "
                         f"{floor} (MIN)")
    return {"count": count}


def _resize(action: str, job: Job, held: Sequence[str], raw: Mapping[str, Any]) -> dict[str, Any]:
    n, now, floor, most = _whole("nodes", raw.get("nodes")), len(held), max(job.min_nodes, 1), most_nodes(job)
    if n == now:
        raise ValueError(f"job {job.name} already runs on {now} nodes")
    if (action == "grow") != (n > now):
        raise ValueError(f"{action} needs a node count {'above' if action == 'grow' else 'below'} the {now} nodes held now")
    if n < floor:
        raise ValueError(f"{n} nodes is below job {job.name}'s MIN of {floor} nodes")
    if n > most:
        raise ValueError(f"job {job.name} can use at most {most} nodes "
                         + ("(its --nnodes MAX)" if job.max_nodes else f"({job.max_devices} devices)"))
    return {"nodes": n}


def validate_request(job: Job, held: Sequence[str], pending: Sequence[AdminRequest], action: str,
                     raw: Mapping[str, Any]) -> dict[str, Any]:
    """Normalised params for `action` on `job`, or ValueError saying why it cannot be queued.

    held: the nodes the job runs on now; pending: its requests not yet carried out (for duplicates);
    raw: the fields given (ints, lists or form text; other keys are ignored)."""
    if action not in REQUEST_ACTIONS:
        raise ValueError(f"unknown action {action[:40]!r}: expected one of {', '.join(REQUEST_ACTIONS)}")
    if job.state != NEEDS_STATE[action]:
        raise ValueError(f"job {job.name} (id {job.id}) is {job.state}, not {NEEDS_STATE[action]}: "
                         f"cannot {action} it")
    if action in ("preempt", "shrink", "grow") and not held:
        raise ValueError(f"job {job.name} (id {job.id}) has not recorded the nodes it runs on yet (its first world "
                         "is starting): try again once `elastic jobs` shows its layout")
    if action == "preempt":
        params = _preempt(job, held, raw)
    elif action in ("shrink", "grow"):
        params = _resize(action, job, held, raw)
    else:
        params = {}
    for req in pending:
        if req.action == action and req.params == params:
            raise ValueError(f"request #{req.id} ({action} {params or ''}) is already pending for job {job.name}")
    return params


def held_nodes(store: "Store", job_id: int) -> list[str]:
    """Nodes the job's current rank map uses, in first-use order."""
    current = store.current_rank_map(job_id)
    return list(dict.fromkeys(e.node for e in current.entries)) if current else []


def check_request(store: "Store", job: Job, action: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    """validate_request against what the store records now (held nodes, pending requests)."""
    return validate_request(job, held_nodes(store, job.id), store.pending_requests(job.id), action, raw)


def check_policy_switch(job: Job, policy: str) -> str:
    """`policy` for `job`, or ValueError saying why the switch cannot be made: the launcher's policy loop runs
    in live mode while the job runs, and the opportunistic policy reads a Slurm partition (launcher.loop.autoscale)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy[:40]!r}: expected one of {', '.join(POLICIES)}")
    if job.state != "running":
        raise ValueError(f"job {job.name} (id {job.id}) is {job.state}, not running: its launcher reads no policy now")
    if job.mode != "live":
        raise ValueError(f"job {job.name} runs in {job.mode} mode: its launcher resizes it only when asked")
    if policy == "opportunistic" and not job.slurm_job_id:
        raise ValueError(f"job {job.name} is not a Slurm job: the opportunistic policy reads a Slurm partition's "
                         "idle nodes and queue")
    if policy == job.policy:
        raise ValueError(f"job {job.name} already runs the {policy} policy")
    return policy
