"""The service's API: POST /api/v1/<method>, the store's methods the CLI and the launchers call, each checked.

Every call carries `Authorization: MUNGE <credential>` whose payload binds it to the method and body
(service.munge); the uid comes from the credential, never from an argument. Each method has one rule below:
what job it touches and what the caller must be allowed (service.authz). A denial answers 403 and is audited
with the proven identity; a job the caller may not see answers as if it did not exist."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Flask, current_app, jsonify, request

from db.errors import NotFoundError
from db.records import Job
from service import authz, munge
from service.codec import CodecError, decode, encode
from service.identity import Caller, caller_of

bp = Blueprint("api", __name__, url_prefix="/api/v1")

# What a method touches: the job named by its first argument, or the job of the migration / request named so.
JOB, MIGRATION, REQUEST = "job", "migration", "request"
READS = {m: JOB for m in ("get_job", "list_nodes", "current_rank_map", "rank_maps", "devices_held", "placement",
                          "fragmentation", "recent_migrations", "pending_requests", "steps", "launch_spec",
                          "why_failed", "gpu_fraction_sla")} | {"get_migration": MIGRATION, "get_request": REQUEST}
WRITES = {m: JOB for m in ("set_job_state", "update_job", "heartbeat", "set_checkpoint", "set_node_state",
                           "record_rank_map", "start_migration", "record_step", "record_steps", "set_launch_spec",
                           "record_policy_watch", "take_request")} | \
         {m: MIGRATION for m in ("finish_migration", "add_migration_notes", "set_pause", "set_resume_step")} | \
         {"complete_request": REQUEST}
LISTINGS = ("list_jobs", "history", "history_count", "jobs_page")  # narrowed to the caller's jobs where private


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _store() -> Any:
    return current_app.extensions["elastic_store"]


def _caller(method: str, body: bytes) -> Caller:
    header = request.headers.get("Authorization", "")
    scheme, _, credential = header.partition(" ")
    if scheme.upper() != "MUNGE":
        raise munge.CredentialError("no munge credential (expected `Authorization: MUNGE <credential>`)")
    cred = munge.verify(credential.strip(), socket=current_app.config.get("MUNGE_SOCKET"))
    if cred.payload != munge.request_payload(method, body):
        raise munge.CredentialError("the credential was made for another request")
    return caller_of(cred.uid, cred.gid, current_app.config.get("OPERATORS_GROUP"),
                     current_app.config.get("SLURM_OPERATOR"))


def _job_of(kind: str, ident: Any) -> Job | None:
    store = _store()
    if not isinstance(ident, int) or isinstance(ident, bool):
        raise Refused(400, f"expected a {kind} id, not {type(ident).__name__}")
    if kind == MIGRATION:
        found = store.get_migration(ident)
        return store.get_job(found.job_id) if found else None
    if kind == REQUEST:
        found = store.get_request(ident)
        return store.get_job(found.job_id) if found else None
    return store.get_job(ident)


def _deny(caller: Caller, method: str, job: Job | None, why: str) -> Refused:
    target = f"job:{job.id}" if job else "service"
    _store().audit(caller.user, f"api:{method}", target, f"denied: {why}", request.remote_addr)
    return Refused(403, why)


def _private() -> bool:
    """Whether the site hides other users' jobs (PRIVATE_JOBS, like Slurm's PrivateData=jobs)."""
    return bool(current_app.config.get("PRIVATE_JOBS"))


def _checked_job(caller: Caller, method: str, kind: str, ident: Any, action: str | None = None) -> Job:
    """The job `ident` names (a job, migration or request id): 404 when the caller may not see it, and 403
    (audited) when `action` is given and the caller may not do it to the job."""
    job = _job_of(kind, ident)
    if job is None or not authz.may_see(caller, job, _private()):
        raise Refused(404, f"no {kind} {ident}")
    if action is not None:
        decision = authz.may_act(caller, job, action)
        if not decision:
            raise _deny(caller, method, job, decision.why)
    return job


def _create_job(caller: Caller, args: list, kwargs: dict) -> Any:
    slurm_job_id = kwargs.get("slurm_job_id")
    owner_uid: Callable[[str], int | None] | None = current_app.config.get("SLURM_JOB_UID")
    if slurm_job_id and owner_uid is not None and not caller.operator:
        uid = owner_uid(str(slurm_job_id))
        if uid is not None and uid != caller.uid:
            raise _deny(caller, "create_job", None, f"Slurm job {slurm_job_id} belongs to uid {uid}, not to "
                                                    f"{caller.user} (uid {caller.uid})")
    kwargs.update(owner=caller.user, owner_uid=caller.uid)
    return _store().create_job(*args, **kwargs)


def _queue_request(caller: Caller, args: list, kwargs: dict) -> Any:
    job_id, action = args[0], str(args[1])
    _checked_job(caller, action, JOB, job_id, action)
    return _store().queue_request(job_id, action, args[2], caller.user)


def _set_policy(caller: Caller, args: list, kwargs: dict) -> Any:
    _checked_job(caller, "policy", JOB, args[0], "switch the policy of")
    return _store().set_policy(*args, **kwargs)


def _audit(caller: Caller, args: list, kwargs: dict) -> Any:
    who, rest = str(args[0]), args[1:4]
    proven = caller.user if who == caller.user else f"{caller.user} ({who})"  # the store clips it to MAX_NAME
    return _store().audit(proven, *rest, request.remote_addr)


def _audit_log(caller: Caller, args: list, kwargs: dict) -> Any:
    """One job's audit rows (the launcher reads how its requests were queued), for whoever may see the job."""
    target = kwargs.get("target") if "target" in kwargs else (args[1] if len(args) > 1 else None)
    if not (isinstance(target, str) and target.startswith("job:") and target[4:].isdigit()):
        raise Refused(400, "audit_log through the service takes target='job:N' (the dashboard shows the rest)")
    _checked_job(caller, "audit_log", JOB, int(target[4:]))
    limit = kwargs.get("limit", args[0] if args else 50)
    return _store().audit_log(limit=min(int(limit), 1000), target=target)


def _find_job(caller: Caller, args: list, kwargs: dict) -> Any:
    ref = args[0]
    job = _store().find_job(ref, owner=caller.user) if isinstance(ref, str) and not ref.isdigit() else None
    job = job or _store().find_job(ref)
    return job if job is not None and authz.may_see(caller, job, _private()) else None


def _listing(method: str) -> Callable[[Caller, list, dict], Any]:
    def call(caller: Caller, args: list, kwargs: dict) -> Any:
        kwargs["owner"] = authz.owner_filter(caller, _private())
        return getattr(_store(), method)(*args, **kwargs)
    return call


SPECIAL: dict[str, Callable[[Caller, list, dict], Any]] = {
    "create_job": _create_job, "queue_request": _queue_request, "set_policy": _set_policy, "audit": _audit,
    "find_job": _find_job, "audit_log": _audit_log, **{m: _listing(m) for m in LISTINGS},
}


def _dispatch(caller: Caller, method: str, args: list, kwargs: dict) -> Any:
    if method in SPECIAL:
        return SPECIAL[method](caller, args, kwargs)
    kind, action = (READS[method], None) if method in READS else (WRITES[method], "change the records of")
    if not args:
        raise Refused(400, f"{method} needs a {kind} id")
    try:
        _checked_job(caller, method, kind, args[0], action)
    except Refused as exc:
        if exc.status == 404 and method in ("get_job", "get_migration", "get_request"):
            return None  # as the store answers for an unknown id
        raise
    return getattr(_store(), method)(*args, **kwargs)


def _error(status: int, kind: str, message: str) -> Any:
    return jsonify({"error": message, "kind": kind}), status


@bp.post("/<method>")
def call(method: str) -> Any:
    body = request.get_data(cache=False)
    if method not in SPECIAL and method not in READS and method not in WRITES:
        return _error(404, "no_method", f"{method[:60]!r} is not a method of the service's API")
    try:
        caller = _caller(method, body)
    except munge.CredentialError as exc:
        _store().audit("anonymous", f"api:{method}", "service", f"denied: {exc}", request.remote_addr)
        return _error(401, "credential", str(exc))
    try:
        payload = json.loads(body) if body else {}
        if not isinstance(payload, dict):
            raise CodecError("the body is a JSON object with args and kwargs")
        args, kwargs = decode(payload.get("args", [])), decode(payload.get("kwargs", {}))
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise CodecError("args must be a list and kwargs a map")
        return jsonify({"result": encode(_dispatch(caller, method, args, kwargs))})
    except Refused as exc:
        return _error(exc.status, "denied" if exc.status == 403 else "not_found" if exc.status == 404 else "bad",
                      str(exc))
    except NotFoundError as exc:
        return _error(404, "not_found", str(exc))
    except (ValueError, TypeError, KeyError, CodecError) as exc:
        return _error(400, "bad", f"{type(exc).__name__}: {exc}")


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
