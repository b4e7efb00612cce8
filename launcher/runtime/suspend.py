"""A `suspend` event on a worker: its part of one checkpoint of the agreed step, then the end of it."""
from __future__ import annotations

import time

from launcher.runtime import ckpt as runtime_ckpt
from launcher.runtime.state import state_views
from launcher.wire.env import ENV_CKPT_DIR


def suspend(job, ev: dict) -> bool:
    """Write the state once at the agreed boundary (every training rank its part), then end (False)."""
    if job.model is None or job.broken or job.device not in job.devices:
        return False
    result: dict = {"ok": False, "step": job.step, "phases": {}}
    t0 = time.perf_counter()
    try:
        if not job.ckpt_dir:
            raise RuntimeError(f"${ENV_CKPT_DIR} is unset")
        path = runtime_ckpt.save(job.ckpt_dir, state_views(job.model, job.optimizer), job.builder.manifests(
            job.layout.name)[job.layout.rank], job.layout.stage_mesh, job.carried, job.step, job.layout.rank)
        result.update(ok=True, path=path, phases={"other": time.perf_counter() - t0})
        job.log(f"suspended: state of step {job.step} written to {path}")
    except runtime_ckpt.failures() as exc:
        result["error"] = f"device {job.device}: checkpoint of step {job.step} failed: {type(exc).__name__}: {exc}"
        job.log(result["error"])
    job.ctl.set_result(ev["epoch"], job.device, result)  # the launcher reads the folder once all reported
    return False
