"""The launcher answers requests through the same validation as the CLI and the dashboard
(db.requests): a request that no longer fits the job is failed with the reason, nothing moves."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.launcher.backends.slurm.test_companion import Slurm, make_launcher


@pytest.mark.parametrize("action, params, message", [
    ("preempt", {"count": 2}, "needs at least 2 (MIN)"),          # would leave 0 of 2 nodes; MIN 2
    ("preempt", {"nodes": ["n2"]}, "needs at least 2 (MIN)"),
    ("shrink", {"nodes": 1}, "below job elastic-it's MIN of 2"),
    ("resume", {}, "is running, not suspended"),
])
def test_launcher_refuses_what_the_shared_validation_refuses(tmp_path: Path, action: str, params: dict,
                                                             message: str) -> None:
    slurm = Slurm()
    la, store = make_launcher(slurm, tmp_path)
    store.update_job(la.job_id, min_nodes=2)  # what the launcher records from --nnodes 2:4
    rid = store.add_request(la.job_id, action, params, "tester")
    (req,) = store.pending_requests(la.job_id)
    la.handle_request(req)
    done = store.get_request(rid)
    assert done is not None and done.status == "failed" and message in (done.message or "")
    assert all(c[:2] == ["scontrol", "show"] for c, _ in slurm.calls)  # only looked, changed nothing
    assert store.recent_migrations(la.job_id) == []
