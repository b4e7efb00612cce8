"""A batch script that Slurm requeued after its node failed (`sbatch --requeue`) takes over the job its
previous run drove (launcher.loop.suspend.requeued_job): only that job (same name, same Slurm job, still
running, live mode), however fresh its last heartbeat; with no checkpoint to go on from, the job ends as
failed with one line saying why and what to run. The whole path on the real testbed, with the batch node
crashed: tests/launcher/backends/slurm/test_batch_node_crash.py."""
from __future__ import annotations

import pytest

from db import Store
from launcher.backends.slurm.parse import JobInfo
from launcher.errors import NothingToDo, UsageError
from launcher.launch import check_resumable
from launcher.loop.suspend import requeued_job, takeover
from launcher.options import Options

REQUEUED = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "1"}


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path}/e.db")
    jid = s.create_job("gpt", "pp2tp1dp2", 2, 4, slurm_job_id="41", nodes=["n1", "n2"])
    s.update_job(jid, mode="live", last_step=17)
    s.heartbeat(jid, None)  # fresh: the old launcher died with its node a moment ago
    yield s
    s.close()


@pytest.mark.parametrize("env, slurm_job_id, name, found", [
    (REQUEUED, "41", "gpt", True),
    ({"SLURM_JOB_ID": "41"}, "41", "gpt", False),  # the first run of the script: nothing to take over
    ({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "0"}, "41", "gpt", False),
    ({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}, "42", "gpt", False),  # another Slurm job's row
    (REQUEUED, "41", "bert", False),  # another name
    (REQUEUED, None, "gpt", False),  # the local backend
])
def test_only_the_same_running_job_is_taken_over(store: Store, env, slurm_job_id, name, found) -> None:
    job = requeued_job(store, name, slurm_job_id, env)
    assert (job is not None) == found
    if found:
        assert job.id == store.find_job("gpt").id


def test_a_finished_or_restart_mode_job_is_not_taken_over(store: Store) -> None:
    jid = store.find_job("gpt").id
    store.update_job(jid, mode="restart")  # its script resumes from its own checkpoints
    assert requeued_job(store, "gpt", "41", REQUEUED) is None
    store.update_job(jid, mode="live")
    store.set_job_state(jid, "finished")
    assert requeued_job(store, "gpt", "41", REQUEUED) is None


def test_with_nothing_to_resume_from_the_requeued_job_fails_saying_why(store: Store, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    opts = Options(min_nodes=1, max_nodes=2, gpus_per_node=2, layouts=[], command=["python", "train.py"],
                   job_name="gpt", checkpoint_dir=tmp_path / "ck")
    with pytest.raises(UsageError, match="Slurm requeued job gpt after its node failed, but nothing to resume"):
        check_resumable(opts, store, "41")
    job = store.find_job("gpt")
    assert job.state == "failed" and "--checkpoint-every" in store.why_failed(job.id)


def test_with_a_checkpoint_the_requeued_run_resumes(store: Store, tmp_path, monkeypatch) -> None:
    (tmp_path / "ck" / "step-12").mkdir(parents=True)
    (tmp_path / "ck" / "step-12" / ".metadata").write_bytes(b"x")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    opts = Options(min_nodes=1, max_nodes=2, gpus_per_node=2, layouts=[], command=["python", "train.py"],
                   job_name="gpt", checkpoint_dir=tmp_path / "ck")
    check_resumable(opts, store, "41")
    assert (opts.resume, opts.requeued) == (True, 2) and store.find_job("gpt").state == "running"


# -- the successor: a second Slurm job queued behind the first (launcher.backends.slurm.successor) --------------
def _opts(tmp_path):
    return Options(min_nodes=1, max_nodes=2, gpus_per_node=2, layouts=[], command=["python", "train.py"],
                   job_name="gpt", checkpoint_dir=tmp_path / "ck")


def test_the_successor_takes_over_the_job_its_predecessor_drove(store: Store, tmp_path, monkeypatch) -> None:
    (tmp_path / "ck" / "step-12").mkdir(parents=True)
    (tmp_path / "ck" / "step-12" / ".metadata").write_bytes(b"x")
    monkeypatch.setenv("SLURM_JOB_ID", "57")  # its own Slurm job; the predecessor was 41
    monkeypatch.setenv("ELASTIC_SUCCESSOR_OF", "41")
    assert requeued_job(store, "gpt", "57", successor_of="41").id == store.find_job("gpt").id
    assert requeued_job(store, "gpt", "57", successor_of="40") is None  # another job's successor
    opts = _opts(tmp_path)
    check_resumable(opts, store, "57")
    assert (opts.resume, opts.requeued, opts.successor_of) == (True, 1, "41")
    assert "taken over by the successor" in takeover(opts)


def test_a_successor_whose_job_ended_cleanly_has_nothing_to_do(store: Store, tmp_path, monkeypatch) -> None:
    store.set_job_state(store.find_job("gpt").id, "finished")
    monkeypatch.setenv("ELASTIC_SUCCESSOR_OF", "41")
    with pytest.raises(NothingToDo, match="successor of Slurm job 41: job gpt is finished .* nothing to take over"):
        check_resumable(_opts(tmp_path), store, "57")


def test_the_successor_without_a_checkpoint_fails_the_job_saying_why(store: Store, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ELASTIC_SUCCESSOR_OF", "41")
    with pytest.raises(UsageError, match="the successor of job gpt found its launcher gone, but nothing to resume"):
        check_resumable(_opts(tmp_path), store, "57")
    assert store.find_job("gpt").state == "failed"


class _Slurm:
    """A fake Slurm client: what the successor asks of it, recorded; jobs and node states as the test sets."""

    def __init__(self, jobs=None, nodes=None):
        self.calls, self.jobs, self.nodes, self.next_id = [], dict(jobs or {}), dict(nodes or {}), 99

    def batch_script(self, job_id):
        return f"#!/bin/bash\n#SBATCH --nodes=2 --no-kill\nelastic-launch ... # job {job_id}\n"

    def submit(self, script, env=None, extra_args=()):
        self.calls.append(("submit", script, env, list(extra_args)))
        self.next_id += 1
        self.jobs[self.next_id] = JobInfo(self.next_id, "PENDING", [], None, 0)
        return self.next_id

    def hold(self, job_id, seconds):
        self.calls.append(("hold", job_id, seconds))
        if job_id not in self.jobs or self.jobs[job_id].state != "PENDING":
            raise RuntimeError("Job is no longer pending execution")

    def job_info(self, job_id):
        if job_id not in self.jobs:
            raise RuntimeError("Invalid job id specified")
        return self.jobs[job_id]

    def node_states(self, nodes, max_age=0.0):
        return {n: self.nodes[n] for n in nodes if n in self.nodes}

    def cancel(self, job_id):
        self.calls.append(("cancel", job_id))


def test_the_successor_is_its_own_batch_script_held_in_the_queue_while_the_launcher_lives(monkeypatch, tmp_path):
    """What is submitted: the script Slurm keeps for the job, its environment naming the predecessor, not to
    start before HOLD_S from now, on MIN..MAX nodes; every POSTPONE_S the launcher pushes that start back;
    one that is gone (started while the pushes failed, found the launcher alive, left) is queued anew."""
    from launcher.backends.slurm import successor as mod

    slurm, clock = _Slurm(), [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])
    monkeypatch.chdir(tmp_path)
    succ = mod.Successor(slurm, 41, "gpt", 1, 2)
    assert succ.submit() == 100
    (_, script, env, args), = slurm.calls
    assert script.endswith("# job 41\n") and env == {"ELASTIC_SUCCESSOR_OF": "41"}
    assert args == [f"--begin=now+{mod.HOLD_S}", "--job-name=gpt", f"--chdir={tmp_path}", "--nodes=1-2"]
    assert succ.keep() is None and slurm.calls[-1][0] == "submit"  # too soon to push
    clock[0] += mod.POSTPONE_S
    assert succ.keep() is None and slurm.calls[-1] == ("hold", 100, mod.HOLD_S)
    slurm.jobs[100] = JobInfo(100, "RUNNING", ["n3"], "n3", 1)  # started: the pushes had failed for a minute
    clock[0] += mod.POSTPONE_S
    assert succ.keep() == "successor job 100 is gone; queued job 101 instead" and succ.id == 101
    succ.cancel()
    assert slurm.calls[-1] == ("cancel", 101) and succ.id is None


@pytest.mark.parametrize("job, node, cancelled, why", [
    (None, None, False, "it has ended"),  # gone from Slurm's memory
    (JobInfo(41, "COMPLETED", [], "n1", 2), None, False, "has ended (COMPLETED)"),
    (JobInfo(41, "CANCELLED", ["n1"], "n1", 1), ("down", False), False, "has ended (CANCELLED)"),  # node lost
    (JobInfo(41, "RUNNING", ["n1", "n2"], "n1", 2), ("down", False), True, "lost its batch node n1 (down)"),
    (JobInfo(41, "RUNNING", ["n2"], "n1", 1), ("idle", True), True, "lost its batch node n1"),  # taken out of it
    (JobInfo(41, "RUNNING", ["n1", "n2"], "n1", 2), ("mixed", False), False, None),  # a missed ping: alive
    (JobInfo(41, "RUNNING", ["n1", "n2"], "n1", 2), ("mixed", True), False, None),
])
def test_a_successor_takes_over_only_from_a_job_that_ended_or_lost_its_batch_node(job, node, cancelled, why):
    from launcher.backends.slurm.successor import takeover_reason

    slurm = _Slurm({41: job} if job else {}, {"n1": node} if node else {})
    got = takeover_reason(slurm, "41")
    assert (got is None) == (why is None) and (why is None or why in got), got
    assert (("cancel", 41) in slurm.calls) == cancelled


def test_a_successor_leaves_a_job_its_user_cancelled() -> None:
    """scancel kills the launcher; one killed before it cancelled its successor (SIGKILL after KillWait) left the
    successor queued, which took the cancelled job over and trained on (seen in bench-rpc on 22.05). A
    cancelled job whose batch node is up is not a loss: the successor leaves it."""
    from launcher.backends.slurm.successor import JobCancelled, takeover_reason

    slurm = _Slurm({41: JobInfo(41, "CANCELLED", ["n1", "n2"], "n1", 2)}, {"n1": ("idle", True)})
    with pytest.raises(JobCancelled, match="cancelled .scancel. with its batch node n1 up"):
        takeover_reason(slurm, "41")
    assert ("cancel", 41) not in slurm.calls


def test_a_successor_leaves_a_job_whose_launcher_lives(store: Store, tmp_path, monkeypatch) -> None:
    """The successor started because slurmctld did not answer the launcher's pushes for a minute: the job runs,
    its batch node is up, so it leaves (exit 0) and the launcher queues a new one."""
    monkeypatch.setenv("ELASTIC_SUCCESSOR_OF", "41")

    class Alive:
        def takeover_reason(self, predecessor):
            return None

    with pytest.raises(NothingToDo, match="that job runs and its batch node is up"):
        check_resumable(_opts(tmp_path), store, "57", Alive())
    assert store.find_job("gpt").state == "running"
