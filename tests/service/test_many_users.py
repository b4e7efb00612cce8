"""Many users, one cluster, one service: real Unix users (scripts/install-test-users.sh), the testbed's real munged
and Slurm, `elastic serve` holding a database no user can open, and the CLI and a launcher run as those users.

The oracle is the database itself, read directly by the test (root): who queued what, what the audit log names,
what ran. elastic-alice owns a running job; elastic-bob is refused on every path (the CLI, a direct call with no
credential, with his own, with Alice's replayed, made for another request, or expired) and audited as himself;
elastic-ops (a member of the operators group) may act on every job; a launcher cannot claim a Slurm job of
another uid, nor write another user's job's records."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from db import Store
from migrate.localrun import free_port
from service import munge
from service.codec import encode
from tests.launcher.backends.slurm.test_launch_slurm import wait

pytestmark = [pytest.mark.slurm, pytest.mark.slurm_host]
ROOT = Path(__file__).resolve().parents[2]
ELASTIC = str(ROOT / ".venv" / "bin" / "elastic")
USERS = ("elastic-alice", "elastic-bob", "elastic-ops")
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"  # util-linux: run a command as another user


def as_user(user: str, *cmd: str, cwd: str = "/tmp", stdin: str | None = None, timeout: float = 120):
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(ROOT)}
    return subprocess.run([RUNUSER, "-u", user, "--", *cmd], cwd=cwd, env=env, input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def credential(user: str, method: str, body: bytes, ttl: int = 60) -> str:
    done = as_user(user, "munge", "--string", munge.request_payload(method, body), "--ttl", str(ttl))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def post(url: str, method: str, body: bytes, cred: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"MUNGE {cred}"} if cred else {})}
    req = urllib.request.Request(f"{url}/api/v1/{method}", data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _answers(url: str) -> bool:
    try:
        return post(url, "list_jobs", b"{}", None)[0] == 401
    except urllib.error.URLError:
        return False


def body(*args, **kwargs) -> bytes:
    return json.dumps({"args": encode(list(args)), "kwargs": encode(kwargs)}).encode()


@pytest.fixture(scope="module")
def service(slurm_testbed, tmp_path_factory):
    """`elastic serve` as root on a SQLite file in a directory only root may enter; (url, db url)."""
    for user in USERS:
        try:
            pwd.getpwnam(user)
        except KeyError:
            pytest.fail(f"no Unix user {user}: run scripts/install-test-users.sh (make test does)")
    private = tmp_path_factory.mktemp("service")
    private.chmod(0o700)
    db_url, port = f"sqlite:///{private}/e.db", free_port()
    Store(db_url).close()
    env = {**os.environ, **slurm_testbed.env(), "ELASTIC_SECRET_KEY": "s" * 32}
    proc = subprocess.Popen([ELASTIC, "serve", "--db", db_url, "--port", str(port), "--operators-group",
                             "elastic-operators"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    wait("the service", lambda: _answers(url) or proc.poll() is not None)
    assert proc.poll() is None, proc.stderr.read()
    yield url, db_url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def alices_job(service):
    """Alice's live job, started by her own elastic-launch through the service (local backend, 2 nodes x 1), in a
    directory of hers (pytest's own are root's only)."""
    url, db_url = service
    home = Path(tempfile.mkdtemp(prefix="elastic-alice-"))
    os.chown(home, pwd.getpwnam("elastic-alice").pw_uid, -1)
    cmd = [RUNUSER, "-u", "elastic-alice", "--", str(ROOT / ".venv" / "bin" / "elastic-launch"), "--nnodes", "1:2",
           "--gpus-per-node", "1", "--db", url, "--job-name", "alice-train", "--log-dir", f"{home}/logs", "--",
           sys.executable, "-m", "launcher.worker", "--layers", "2", "--hidden", "32", "--vocab", "64",
           "--steps", "4000", "--step-sleep", "0.05", "--log-every", "0"]
    proc = subprocess.Popen(cmd, cwd=home, env={"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=open(home / "launch.log", "w"))
    store = Store(db_url)
    job = wait("Alice's job training", lambda: (j := store.find_job("alice-train")) and j.last_step and j)
    yield store, job, home
    proc.terminate()
    proc.wait(timeout=60)
    store.close()
    shutil.rmtree(home, ignore_errors=True)


def audited(store: Store, who: str, text: str) -> bool:
    return any(r.who == who and text in r.result for r in store.audit_log(limit=200))


def test_a_job_belongs_to_its_launchers_user_and_no_user_can_open_the_database(service, alices_job):
    store, job, _ = alices_job
    assert (job.owner, job.owner_uid) == ("elastic-alice", pwd.getpwnam("elastic-alice").pw_uid)
    db_file = service[1].removeprefix("sqlite:///")
    opened = as_user("elastic-alice", sys.executable, "-c", f"open({db_file!r}, 'rb')")
    assert opened.returncode != 0 and "PermissionError" in opened.stderr


def test_another_user_is_refused_on_every_path_and_audited_as_himself(service, alices_job):
    url, _ = service
    store, job, _ = alices_job
    for cmd in (["resize", "alice-train", "--nodes", "1"], ["suspend", str(job.id)], ["preempt", str(job.id),
                                                                                       "--count", "1"]):
        done = as_user("elastic-bob", ELASTIC, *cmd, "--db", url)
        assert done.returncode == 1, (cmd, done.stdout, done.stderr)
        assert "refused by the elastic service" in done.stderr and ("belongs to elastic-alice" in done.stderr
                                                                    or "operators only" in done.stderr), done.stderr
    assert not [r for r in store.list_requests(job.id) if r.requested_by == "elastic-bob"]
    assert audited(store, "elastic-bob", "belongs to elastic-alice")
    assert audited(store, "elastic-bob", "preempt is for operators only")
    # a direct call: no credential, his own on Alice's records, Alice's replayed, made for another call, expired
    write = body(job.id, "failed")
    assert post(url, "set_job_state", write, None)[0] == 401
    status, answer = post(url, "set_job_state", write, credential("elastic-bob", "set_job_state", write))
    assert status == 403 and "belongs to elastic-alice" in answer["error"]
    read = body(job.id)
    alice = credential("elastic-alice", "get_job", read)
    assert post(url, "get_job", read, alice)[0] == 200
    status, answer = post(url, "get_job", read, alice)
    assert status == 401 and "Replayed" in answer["error"], answer
    status, answer = post(url, "set_job_state", write, credential("elastic-alice", "get_job", read))
    assert status == 401 and "another request" in answer["error"], answer
    late = credential("elastic-alice", "get_job", read, ttl=1)
    time.sleep(2.5)
    status, answer = post(url, "get_job", read, late)
    assert status == 401 and "Expired" in answer["error"], answer
    assert store.get_job(job.id).state == "running"
    assert audited(store, "anonymous", "Replayed") and audited(store, "anonymous", "Expired")


def test_users_own_jobs_and_operators_every_job(service, alices_job, slurm_testbed):
    url, _ = service
    store, alice_job, home = alices_job
    # Bob registers his job the way his launcher does, and writes its records; Alice cannot touch it
    create = body("bob-train", "pp1tp1dp2", 1, 2, nodes=["n1", "n2"])
    status, answer = post(url, "create_job", create, credential("elastic-bob", "create_job", create))
    assert status == 200, answer
    bob_job = store.get_job(answer["result"])
    assert bob_job.owner == "elastic-bob"
    entries = [{"virtual_rank": r, "node": f"n{r + 1}", "gpu": 0, "pp": 0, "dp": r, "tp": 0} for r in range(2)]
    ranks = body(bob_job.id, 0, "pp1tp1dp2", entries)
    assert post(url, "record_rank_map", ranks, credential("elastic-bob", "record_rank_map", ranks))[0] == 200
    assert post(url, "record_rank_map", ranks, credential("elastic-alice", "record_rank_map", ranks))[0] == 403
    done = as_user("elastic-alice", ELASTIC, "resize", "bob-train", "--nodes", "1", "--db", url)
    assert done.returncode == 1 and "belongs to elastic-bob" in done.stderr, done.stderr
    assert store.pending_requests(bob_job.id) == []
    # the operator may act on both
    done = as_user("elastic-ops", ELASTIC, "preempt", "bob-train", "--count", "1", "--db", url)
    assert done.returncode == 0, done.stderr
    (req,) = store.pending_requests(bob_job.id)
    assert (req.action, req.requested_by) == ("preempt", "elastic-ops")
    # Alice's own job: her resize is carried out by her launcher
    done = as_user("elastic-alice", ELASTIC, "resize", "alice-train", "--nodes", "1", "--db", url)
    assert done.returncode == 0, done.stderr
    rid = int(done.stdout.strip())
    assert store.get_request(rid).requested_by == "elastic-alice"
    try:
        wait("Alice's shrink", lambda: store.get_request(rid).status == "done", timeout=120)
    except AssertionError:
        raise AssertionError(f"{store.get_request(rid)}\n{(home / 'launch.log').read_text()[-3000:]}") from None
    mig = store.recent_migrations(alice_job.id, 1)[0]
    assert (mig.status, mig.to_layout) == ("succeeded", "pp1tp1dp1"), mig.error
    # a launcher cannot claim a Slurm job that runs as another uid (Slurm's UserId, read by the service)
    sleeper = subprocess.run(["sbatch", "--parsable", "--wrap", "sleep 60"], env=slurm_testbed.env(),
                             capture_output=True, text=True, check=True).stdout.strip()
    try:
        claim = body("stolen", "pp1tp1dp1", 1, 1, slurm_job_id=sleeper)
        status, answer = post(url, "create_job", claim, credential("elastic-alice", "create_job", claim))
        assert status == 403 and f"Slurm job {sleeper} belongs to uid 0" in answer["error"], answer
    finally:
        subprocess.run(["scancel", sleeper], env=slurm_testbed.env())


def test_slurms_own_operators_are_the_services_operators(slurm_testbed, monkeypatch):
    """sacctmgr's AdminLevel, read from the testbed's real slurmdbd, makes a user an operator of the service."""
    from launcher.commands.dashboard import SlurmAdminLevel
    from service.identity import caller_of

    env = slurm_testbed.env()
    bob = pwd.getpwnam("elastic-bob")

    def sacctmgr(*args: str) -> None:
        subprocess.run(["sacctmgr", "-i", *args], env=env, capture_output=True, text=True, check=True)

    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])  # the service reads sacctmgr with its own environment
    assert not caller_of(bob.pw_uid, bob.pw_gid, None, SlurmAdminLevel()).operator
    sacctmgr("add", "user", "elastic-bob", "account=root", "adminlevel=Operator")
    try:
        assert caller_of(bob.pw_uid, bob.pw_gid, None, SlurmAdminLevel()).operator
    finally:
        sacctmgr("delete", "user", "elastic-bob")
    assert not caller_of(bob.pw_uid, bob.pw_gid, None, SlurmAdminLevel()).operator
