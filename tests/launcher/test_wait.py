"""`elastic resize/preempt/suspend --wait` (launcher.commands.follow): a request followed to its answer.

How each ending is told apart is checked on a store the test writes as a launcher would (its `sleep`
does the launcher's next step, so nothing depends on time); the whole path on a real local job."""
from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest

from db import Store
from launcher.cli import main as elastic
from launcher.commands.follow import EXIT, follow
from tests.launcher.test_launch_local import run_job


@pytest.fixture
def job(tmp_path):
    store = Store(url := f"sqlite:///{tmp_path}/e.db")
    jid = store.create_job("t", "pp1tp1dp2", 1, 2, nodes=["a", "b"], max_nodes=2)
    store.record_rank_map(jid, 0, "pp1tp1dp2", [{"virtual_rank": r, "node": n, "gpu": 0, "pp": 0, "dp": r, "tp": 0}
                                               for r, n in enumerate("ab")])
    store.heartbeat(jid)
    store.url = url
    yield store, jid
    store.close()


def launcher_steps(store: Store, jid: int, rid: int, migration: str | None, answer: str, message: str):
    """What a launcher does with request `rid`, one step per poll of the wait."""
    mid = []
    steps = [lambda: store.take_request(jid, "host:1")]
    if migration:
        steps.append(lambda: mid.append(store.start_migration(jid, "pp1tp1dp2", "pp1tp1dp1", "resize", {}, {})))
        steps.append(lambda: store.finish_migration(mid[0], migration, 10, 20, True, {}, at_step=7,
                                                    error=None if migration == "succeeded" else message))
    steps.append(lambda: store.complete_request(rid, answer, message))
    if migration == "succeeded":  # the new layout commits its first step after the answer
        steps.append(lambda: store.set_pause(mid[0], 0.25))
    return lambda _s: steps.pop(0)() if steps else pytest.fail("the wait went on after the answer")


@pytest.mark.parametrize("migration, answer, ending", [
    ("succeeded", "done", "done"),
    ("failed", "failed", "failed"),
    ("declined", "failed", "declined"),
    (None, "failed", "refused"),
])
def test_each_ending_has_its_exit_status_and_one_line(job, migration, answer, ending):
    store, jid = job
    rid, _ = store.queue_request(jid, "shrink", {"nodes": 1}, "me")
    out = io.StringIO()
    rc = follow(store, rid, out=out, sleep=launcher_steps(store, jid, rid, migration, answer, "why it ended"))
    assert rc == EXIT[ending]
    lines = out.getvalue().splitlines()
    assert lines[0] == f"request {rid} taken by the launcher (host:1)"
    if migration:
        assert lines[1].startswith("migration ") and "started: pp1tp1dp2 -> pp1tp1dp1 (resize, live)" in lines[1]
        assert f" {migration} at step 7" in lines[2]
    if migration == "succeeded":
        assert lines[3] == f"{lines[1].split(' started')[0]}: training paused 0.25 s (last step committed on the old " \
                           "layout to the first on the new one)"
    assert lines[-1] == f"request {rid} {ending}: why it ended"


def test_a_job_that_ends_before_its_launcher_takes_the_request_is_reported_not_waited_for(job):
    store, jid = job
    rid, _ = store.queue_request(jid, "suspend", {}, "me")
    out = io.StringIO()
    rc = follow(store, rid, out=out, sleep=lambda _s: store.set_job_state(jid, "finished"))
    assert rc == EXIT["unanswered"]
    assert out.getvalue().splitlines()[-1] == (f"request {rid} unanswered: job t is finished: no launcher will take "
                                               f"request {rid}; it stays queued")


def test_a_resume_is_answered_by_the_next_launcher_of_the_job(job):
    """A resume request is not taken: the next elastic-launch of the suspended job answers it once its workers
    loaded the checkpoint; the wait says when the job runs again."""
    store, jid = job
    store.set_job_state(jid, "suspended")
    rid, _ = store.queue_request(jid, "resume", {}, "me")
    steps = [lambda: store.set_job_state(jid, "running"), lambda: store.heartbeat(jid),
             lambda: store.complete_request(rid, "done", "resumed from /ckpt at step 40 on pp1tp1dp2 (2 devices)")]
    out = io.StringIO()
    assert follow(store, rid, out=out, sleep=lambda _s: steps.pop(0)()) == EXIT["done"]
    assert out.getvalue().splitlines() == ["job t is running",
                                           f"request {rid} done: resumed from /ckpt at step 40 on pp1tp1dp2 (2 devices)"]


def test_the_cli_keeps_the_id_on_stdout_and_gives_up_at_the_timeout(job, capsys):
    store, jid = job
    rc = elastic(["resize", str(jid), "--nodes", "1", "--db", store.url, "--wait-timeout", "0"])
    out, err = capsys.readouterr()
    rid = int(out.strip())  # stdout: the id alone, for scripts
    assert rc == EXIT["timeout"] == 124
    assert err.splitlines()[-1].startswith(f"request {rid} timed out after 0 s (not taken by a launcher yet); "
                                           "it stays queued")
    assert store.get_request(rid).status == "pending"


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_resize_and_preempt_wait_for_a_real_job(tmp_path):
    """A shrink followed to its migration's success (exit 0), and a preempt queued behind it that the shrink
    leaves impossible (the last node cannot go): the launcher refuses it (exit 4, its reason)."""
    procs: list[subprocess.Popen] = []

    def queue_both(la, url):
        store = la.db
        for args, n in ((("resize", "t", "--nodes", "1"), 1), (("preempt", "t", "--count", "1"), 2)):
            procs.append(_cli(*args, "--db", url, "--wait"))
            for _ in range(600):  # the launcher waits here, so each is queued against the 2 nodes held now
                if len(store.pending_requests(la.job_id)) == n or procs[-1].poll() is not None:
                    break
                time.sleep(0.1)

    rc, la, store, url = run_job(tmp_path, [(3, queue_both)])  # it ends once both are answered
    assert rc == 0, [o.message for o in la.outcomes]
    (out1, err1), (out2, err2) = (p.communicate(timeout=120) for p in procs)
    shrink, preempt = (r.id for r in reversed(store.list_requests(la.job_id)))
    assert procs[0].returncode == 0, err1
    assert out1.strip() == str(shrink)
    mig = store.recent_migrations(la.job_id, 1)[0]
    lines = err1.splitlines()
    assert lines[0].startswith(f"request {shrink} queued: shrink job t")
    assert lines[1].startswith(f"request {shrink} taken by the launcher (")
    assert lines[2] == f"migration {mig.id} started: pp2tp2dp1 -> pp2tp1dp1 (resize, live)"
    assert lines[3].startswith(f"migration {mig.id} succeeded at step {mig.at_step}: now on pp2tp1dp1")
    assert lines[-1].startswith(f"request {shrink} done: ")  # after the pause, when the job measured it in time
    assert procs[1].returncode == EXIT["refused"], err2
    assert out2.strip() == str(preempt)
    assert err2.splitlines()[-1].startswith(f"request {preempt} refused: ") and "none can go" in err2
