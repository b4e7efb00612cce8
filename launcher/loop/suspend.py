"""Suspend and resume: the job's state written once into a checkpoint, and a later run going on from it.

Suspend (USR1 with --on-signal suspend, a `suspend` request): every training worker writes its
part of the state (launcher.runtime.ckpt) into --checkpoint-dir/step-<S> at one agreed step boundary
and exits; the job is recorded as suspended with that checkpoint. `elastic-launch --resume` (or a
pending `resume` request for the suspended job) loads it on whatever layout and device count the
new run gets and goes on at step S+1, as the same job in the database.
"""
from __future__ import annotations

import os
from pathlib import Path

from db.liveness import lost_since
from launcher.backends.slurm.successor import HOLD_S
from launcher.loop.outcome import MigrationFailed, Outcome
from launcher.wire.folders import latest_checkpoint


def resume_checkpoint(job, ckpt_dir: str, requeued: bool = False) -> str | None:
    """The checkpoint a resume starts from: the suspended `job`'s own (db.records.Job or None), else the
    newest complete one in `ckpt_dir` (a lost or requeued job's launcher recorded its newest one: used when
    `ckpt_dir` holds none); None when there is none."""
    recorded = job is not None and job.checkpoint_path and (Path(job.checkpoint_path) / ".metadata").exists()
    if recorded and job.state == "suspended":
        return job.checkpoint_path
    found = latest_checkpoint(ckpt_dir)
    return found[0] if found else job.checkpoint_path if recorded and (lost_since(job) or requeued) else None


def requeued_job(db, job_name: str, slurm_job_id: str | None, env=os.environ, successor_of: str | None = None):
    """The job this launcher's previous run drove, when Slurm restarted the batch script because its node
    failed (`sbatch --requeue`: SLURM_RESTART_COUNT counts the restarts; the job id stays), or when this run is
    the successor queued behind that run's Slurm job (`successor_of`: launcher.backends.slurm.successor): the
    same name and Slurm job, still recorded as running in live mode. Its previous launcher is gone with the node
    (or with its Slurm job, which a successor starts only after), however fresh its last heartbeat. None
    otherwise."""
    if successor_of is not None:
        slurm_job_id = successor_of
    elif not slurm_job_id or not (env.get("SLURM_RESTART_COUNT") or "0").isdigit() or \
            int(env.get("SLURM_RESTART_COUNT") or 0) == 0 or env.get("SLURM_JOB_ID") != str(slurm_job_id):
        return None
    job = db.find_job(job_name)
    ok = job is not None and job.state == "running" and str(job.slurm_job_id) == str(slurm_job_id)
    return job if ok and job.mode == "live" else None


def takeover(opts) -> str:
    """Why this run takes the job over: Slurm requeued it, or it is the job's successor."""
    if opts.successor_of is not None:
        return (f"taken over by the successor held in the queue behind Slurm job {opts.successor_of}: "
                f"{opts.successor_why or 'that job ended'}")
    return f"Slurm requeued its batch script after its node failed (restart {opts.requeued})"


def queue_successor(opts, backend, log, audit) -> None:
    """Live mode with safety checkpoints: queue the job's successor where the backend can (Slurm), what brings
    the job back when its batch node is lost; the survival claim follows (backend.successor)."""
    if opts.checkpoint_every <= 0:
        return  # nothing it could resume from: the batch node's loss stays unsurvived, and is said so
    try:
        sid = backend.queue_successor(opts.job_name, opts.min_nodes, opts.max_nodes)
    except Exception as exc:  # noqa: BLE001 -- said; the job runs, without that cover
        log(f"could not queue the job's successor ({exc}): the loss of the batch node would end the job")
        return
    if sid is not None:
        log(f"successor job {sid} held in the queue while this launcher lives: if the batch node is lost, it "
            f"starts within {HOLD_S} s and resumes the job from its newest safety checkpoint")
        audit("successor", f"Slurm job {sid} queued to take the job over if its batch node is lost")


def nothing_to_resume(job_name: str, ckpt_dir: str) -> str:
    return (f"nothing to resume: job {job_name!r} has no checkpoint in the database and {ckpt_dir} holds no "
            "complete one (--checkpoint-dir says where to look)")


def resume_point(opts, recorder, ckpt_dir: str):
    """(job to continue or None, checkpoint to start from or None, `resume` requests it answers)."""
    db = recorder.db
    job = db.find_job(opts.job_name)
    requests = [r for r in db.pending_requests(job.id) if r.action == "resume"] \
        if job is not None and job.state == "suspended" else []
    if not opts.resume and not requests:
        return None, None, []
    path = resume_checkpoint(job, ckpt_dir, bool(opts.requeued))
    if path is None:
        raise MigrationFailed(nothing_to_resume(opts.job_name, ckpt_dir))
    if job is not None and job.state != "suspended" and lost_since(job) is None and not opts.requeued:
        job = None  # a finished or running job of that name: the resumed run is a new job
    if job is not None and job.state == "running":  # lost: nobody drives it, this launcher takes it over
        why = takeover(opts) if opts.requeued else f"lost since {lost_since(job):%Y-%m-%d %H:%M:%S} UTC"
        recorder.log(f"taking over job {opts.job_name} (id {job.id}), {why}, at step {job.last_step}")
    recorder.log(f"resuming job {opts.job_name} from {path}")
    return job, path, requests


def continue_job(recorder, holdings, opts, job, nodes: list[str], slurm_job_id) -> None:
    """Take over a suspended job's row: new allocation, epochs after its last rank map."""
    db, batch = recorder.db, holdings.backend.batch_node
    last = db.current_rank_map(job.id)
    recorder.epoch_base = last.epoch + 1 if last else 0
    db.update_job(job.id, slurm_job_id=slurm_job_id, pinned_node=batch,
                  max_devices=max(job.max_devices, opts.max_nodes * holdings.gpn), min_nodes=opts.min_nodes,
                  max_nodes=opts.max_nodes)
    for n in db.list_nodes(job.id):
        if n.name not in nodes and n.state in ("active", "idle"):
            db.set_node_state(job.id, n.name, "released", pinned=False)
    for n in nodes:
        db.set_node_state(job.id, n, "active", pinned=n == batch, **holdings.node_shape(n))
    db.set_job_state(job.id, "running")


def finish_resume(mode, path: str, requests, requeued=None, why: str = "") -> None:
    """Wait until every worker loaded the checkpoint `path` (event 0); answer the `resume` requests. A job
    taken over after Slurm requeued it (`requeued`: its record before) gets a `requeue` migration in its
    history, with the committed steps lost."""
    db, rec = mode.recorder.db, mode.recorder
    try:
        res = mode.results(0, list(mode.current.devices))
    except MigrationFailed as exc:
        for r in requests:
            db.complete_request(r.id, "failed", f"resume failed: {exc}")
        rec.job_state("failed", why=f"resume from {path} failed: {exc}")
        raise MigrationFailed(f"resume from {path} failed: {exc}") from None
    step = min(r["step"] for r in res.values())
    msg = f"resumed from {path} at step {step} on {mode.current.layout} ({len(mode.current.devices)} devices)"
    for r in requests:
        db.complete_request(r.id, "done", msg)
    rec.audit("resume", msg)
    rec.log(msg)
    if requeued is not None:
        record_requeue(mode, requeued, path, step, why)


def record_requeue(mode, job, path: str, step: int, why: str = "") -> None:
    """The requeue as one migration: from the layout the job last ran to the one it resumed on, at the
    checkpoint's step, the steps committed after it lost."""
    rec, lost = mode.recorder, max(job.last_step - step, 0)
    out = Outcome("requeue", False, "", from_layout=job.layout, to_layout=str(mode.current.layout),
                  nodes_after=len(mode.workers.active))
    rec.begin(out, {"restore_from": path, "step": step, "steps_before": job.last_step})
    out.ok, out.at_step = True, step
    out.message = f"{why or 'requeued by Slurm after its node failed'}; resumed from checkpoint at step {step}: " \
                  f"{lost} steps lost"
    size = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    rec.succeeded(out, checkpoint=size, error=out.message, steps_lost=lost)
    rec.log(f"{out.from_layout} -> {out.to_layout}: {out.message}")
    rec.keep(out)


def suspend(mode, trigger: str) -> Outcome:
    """Every training worker writes its part of the state at one agreed step boundary into the
    checkpoint folder, then all exit; the job is recorded as suspended there."""
    out = Outcome(trigger, False, "", from_layout=str(mode.current.layout), nodes_before=len(mode.workers.active))
    e = mode.post({"kind": "suspend"})
    try:
        res = mode.results(e, list(mode.current.devices))
        paths = {r.get("path") for r in res.values()}
        if len(paths) != 1 or not (Path(next(iter(paths))) / ".metadata").exists():
            raise MigrationFailed(f"workers reported checkpoint folders {sorted(map(str, paths))}, none complete")
    except MigrationFailed as exc:
        res, out.message = {}, f"suspend failed, job stopped without a checkpoint: {exc}"
    if res:
        path, step = next(iter(paths)), min(r["step"] for r in res.values())
        mode.finish_all(None, timeout=120)
        mode.recorder.db.set_checkpoint(mode.recorder.job_id, path, step, state="suspended")
        out.ok, out.at_step = True, step
        out.message = f"suspended at step {step}: checkpoint {path}"
        mode.suspended = True
    else:
        mode.finish_all("failed", timeout=120)
    mode.recorder.audit("suspend", out.message)
    return mode.recorder.done(out)
