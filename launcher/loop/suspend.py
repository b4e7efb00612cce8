"""Suspend and resume: the job's state written once into a checkpoint, and a later run going on from it.

Suspend (USR1 with --on-signal suspend, a `suspend` request): every training worker writes its
part of the state (launcher.runtime.ckpt) into --checkpoint-dir/step-<S> at one agreed step boundary
and exits; the job is recorded as suspended with that checkpoint. `elastic-launch --resume` (or a
pending `resume` request for the suspended job) loads it on whatever layout and device count the
new run gets and goes on at step S+1, as the same job in the database.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from launcher.wire.folders import latest_checkpoint
from launcher.loop.outcome import MigrationFailed, Outcome

if TYPE_CHECKING:
    from launcher.loop.launcher import Launcher


def resume_checkpoint(job, ckpt_dir: str) -> str | None:
    """The checkpoint a resume starts from: the suspended `job`'s own (db.records.Job or None), else the
    newest complete one in `ckpt_dir`; None when there is none."""
    if job is not None and job.state == "suspended" and job.checkpoint_path \
            and (Path(job.checkpoint_path) / ".metadata").exists():
        return job.checkpoint_path
    found = latest_checkpoint(ckpt_dir)
    return found[0] if found else None


def nothing_to_resume(job_name: str, ckpt_dir: str) -> str:
    return (f"nothing to resume: job {job_name!r} has no checkpoint in the database and {ckpt_dir} holds no "
            "complete one (--checkpoint-dir says where to look)")


def resume_point(la: "Launcher"):
    """(job to continue or None, checkpoint to start from or None, `resume` requests it answers)."""
    job = la.db.find_job(la.opts.job_name)
    requests = [r for r in la.db.pending_requests(job.id) if r.action == "resume"] \
        if job is not None and job.state == "suspended" else []
    if not la.opts.resume and not requests:
        return None, None, []
    path = resume_checkpoint(job, la.ckpt_dir)
    if path is None:
        raise MigrationFailed(nothing_to_resume(la.opts.job_name, la.ckpt_dir))
    if job is not None and job.state != "suspended":
        job = None  # a finished or running job of that name: the resumed run is a new job
    la.log(f"resuming job {la.opts.job_name} from {path}")
    return job, path, requests


def continue_job(la: "Launcher", job, nodes: list[str]) -> None:
    """Take over a suspended job's row: new allocation, epochs after its last rank map."""
    last = la.db.current_rank_map(job.id)
    la.epoch_base = last.epoch + 1 if last else 0
    la.db.update_job(job.id, slurm_job_id=la.slurm_job_id, pinned_node=la.backend.batch_node,
                     max_devices=max(job.max_devices, la.opts.max_nodes * la.gpn), min_nodes=la.opts.min_nodes,
                     max_nodes=la.opts.max_nodes)
    for n in la.db.list_nodes(job.id):
        if n.name not in nodes and n.state in ("active", "idle"):
            la.db.set_node_state(job.id, n.name, "released", pinned=False)
    for n in nodes:
        la.db.set_node_state(job.id, n, "active", pinned=n == la.backend.batch_node, **la.node_shape(n))
    la.db.set_job_state(job.id, "running")


def finish_resume(la: "Launcher", path: str, requests) -> None:
    """Wait until every worker loaded the checkpoint `path` (event 0); answer the `resume` requests."""
    try:
        res = la.check_results(la.wait_results(0, list(la.current.devices)))
    except MigrationFailed as exc:
        for r in requests:
            la.db.complete_request(r.id, "failed", f"resume failed: {exc}")
        la.db.set_job_state(la.job_id, "failed", why=f"resume from {path} failed: {exc}")
        raise MigrationFailed(f"resume from {path} failed: {exc}") from None
    step = min(r["step"] for r in res.values())
    msg = f"resumed from {path} at step {step} on {la.current.layout} ({len(la.current.devices)} devices)"
    for r in requests:
        la.db.complete_request(r.id, "done", msg)
    la.db.audit("elastic-launch", "resume", f"job:{la.job_id}", msg)
    la.log(msg)


def suspend(la: "Launcher", trigger: str) -> Outcome:
    """Every training worker writes its part of the state at one agreed step boundary into the
    checkpoint folder, then all exit; the job is recorded as suspended there."""
    la.epoch += 1
    out = Outcome(trigger, False, "", from_layout=str(la.current.layout), nodes_before=len(la.active))
    la.ctl.post({"epoch": la.epoch, "kind": "suspend"})
    try:
        res = la.check_results(la.wait_results(la.epoch, list(la.current.devices)))
        paths = {r.get("path") for r in res.values()}
        if len(paths) != 1 or not (Path(next(iter(paths))) / ".metadata").exists():
            raise MigrationFailed(f"workers reported checkpoint folders {sorted(map(str, paths))}, none complete")
    except MigrationFailed as exc:
        res, out.message = {}, f"suspend failed, job stopped without a checkpoint: {exc}"
    if res:
        path, step = next(iter(paths)), min(r["step"] for r in res.values())
        la.finish_all(None, timeout=120)
        la.db.set_checkpoint(la.job_id, path, step, state="suspended")
        out.ok, out.at_step = True, step
        out.message = f"suspended at step {step}: checkpoint {path}"
        la.suspended = True
    else:
        la.finish_all("failed", timeout=120)
    la.db.audit("elastic-launch", "suspend", f"job:{la.job_id}", out.message)
    la.log(out.message)
    la.outcomes.append(out)
    return out
