"""A batch script that Slurm requeued after its node failed (`sbatch --requeue`) takes over the job its
previous run drove (launcher.loop.suspend.requeued_job): only that job (same name, same Slurm job, still
running, live mode), however fresh its last heartbeat; with no checkpoint to go on from, the job ends as
failed with one line saying why and what to run. The whole path on the real testbed, with the batch node
crashed: tests/launcher/backends/slurm/test_batch_node_crash.py."""
from __future__ import annotations

import pytest

from db import Store
from launcher.backends.slurm.successor import submit_successor
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
    assert "successor queued behind it" in takeover(opts)


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


def test_the_successor_is_its_own_batch_script_queued_behind_the_job(monkeypatch, tmp_path) -> None:
    """What is submitted (a fake Slurm client records it): the script Slurm keeps for the job, its environment
    naming the predecessor, queued after the job whatever way it ends, cancelled by Slurm if it never can."""
    calls = []

    class Slurm:
        def batch_script(self, job_id):
            return f"#!/bin/bash\n#SBATCH --nodes=2 --no-kill\nelastic-launch ... # job {job_id}\n"

        def submit(self, script, env=None, extra_args=()):
            calls.append((script, env, list(extra_args)))
            return 99

    monkeypatch.chdir(tmp_path)
    assert submit_successor(Slurm(), 41, "gpt") == 99
    (script, env, args), = calls
    assert script.endswith("# job 41\n") and env == {"ELASTIC_SUCCESSOR_OF": "41"}
    assert args == ["--dependency=afterany:41", "--kill-on-invalid-dep=yes", "--job-name=gpt", f"--chdir={tmp_path}"]
