"""Growing beyond the allocation through a companion job, against a mocked Slurm (no cluster).

The companion job's sbatch line and script are checked against golden files; the decision
logic (which nodes come from the allocation, how many from a companion), the release of a
companion's nodes (shrink or scancel), and the launcher's grow path (a companion that never
starts is cancelled and the grow recorded as failed; one that runs extends the topology and
leads to a grow migration) run against a scripted `SlurmCommands` runner.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from db import Store
from launcher.launch import (
    Launcher,
    Options,
    Outcome,
    build_parser,
    grow_choice,
    options_from_args,
)
from launcher.backends.slurm.nodes import SlurmNodes
from launcher.backends.slurm.client import SlurmCommands
from launcher.backends.slurm.commands import (
    build_companion_args,
    build_companion_command,
    build_companion_script,
    companion_job_name,
)
from launcher.backends.slurm.parse import JobInfo
from migrate.layout import ParallelConfig
from migrate.topology import RankMap

from tests.paths import GOLDEN


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(), f"differs from {path} (UPDATE_GOLDEN=1 to accept)"


# ------------------------------------------------------------------ builders
@pytest.mark.parametrize("name, build", [
    ("cmd_sbatch_companion", lambda: build_companion_command(
        "elastic-it", 1, 2, 2, "debug", ["n1", "n2"], "/var/log/elastic/companion-1-%j.out", of_job=17)),
    ("cmd_sbatch_companion_minimal", lambda: build_companion_command("train", 3, 1, 4)),
])
def test_companion_command_matches_golden(name, build) -> None:
    built = build()
    assert all(isinstance(part, str) for part in built)
    golden(f"{name}.txt", "\n".join(built) + "\n")


def test_a_grow_of_the_policy_asks_for_whole_nodes() -> None:
    """--policy opportunistic counts whole idle nodes: its grows' companions are --exclusive (two elastic jobs'
    companions packed onto one node's free GPUs on the testbed, and a yield then freed no whole node); an
    admin's grow keeps sharing allowed."""
    policy = build_companion_command("train", 3, 1, 4, whole=True)
    assert "--exclusive" in policy and "--exclusive" not in build_companion_command("train", 3, 1, 4)
    assert policy[:-3] + policy[-2:] == build_companion_command("train", 3, 1, 4)


def test_companion_command_asks_for_whole_nodes_like_the_job() -> None:
    cmd = build_companion_command("elastic-it", 2, 3, 4, "gpu", ["n1", "n2", "n5"])
    assert cmd[:2] == ["sbatch", "--parsable"]  # the script goes on stdin
    for flag in ("--job-name=elastic-it-companion-2", "--partition=gpu", "--nodes=3", "--gres=gpu:4",
                 "--ntasks-per-node=4", "--exclude=n[1-2,5]", "--no-requeue", "--no-kill"):
        assert flag in cmd
    assert companion_job_name("x", 7) == "x-companion-7"


def test_companion_script_matches_golden_and_ends_with_the_main_job() -> None:
    script = build_companion_script(42)
    golden("companion_script.txt", script)
    assert script.startswith("#!/bin/bash\n")
    assert "scontrol show job 42" in script and "exit 0" in script


def test_companion_script_ends_when_main_job_is_gone_not_when_slurmctld_is_silent(tmp_path: Path) -> None:
    """Run the script with a fake scontrol: it keeps holding while the main job runs or slurmctld
    does not answer, and exits once the job is reported ended."""
    counter = tmp_path / "n"
    counter.write_text("0")
    fake = tmp_path / "scontrol"
    fake.write_text(f"""#!/bin/bash
n=$(cat {counter}); echo $((n+1)) > {counter}
case $n in
  0) echo "JobId=42 JobState=RUNNING Reason=None";;
  1) echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2; exit 1;;
  *) echo "JobId=42 JobState=COMPLETED Reason=None";;
esac
""")
    fake.chmod(0o755)
    script = build_companion_script(42, poll_s=0)
    res = subprocess.run(["bash", "-c", script], env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
                         timeout=20, capture_output=True, text=True, check=False)
    assert res.returncode == 0
    assert counter.read_text().strip() == "3"


@pytest.mark.parametrize("kwargs, words", [({"nodes": 0}, "nodes must be"), ({"gpus_per_node": 0}, "gpus_per_node")])
def test_companion_builder_rejects_bad_input(kwargs, words) -> None:
    args = {"job_name": "j", "n": 1, "nodes": 1, "gpus_per_node": 1}
    args.update(kwargs)
    with pytest.raises(ValueError, match=words):
        build_companion_args(**args)


# ------------------------------------------------------------- the decision
@pytest.mark.parametrize("active, alloc, gone, want, take, missing", [
    (["n1", "n2"], ["n1", "n2", "n3", "n4"], set(), 4, ["n3", "n4"], 0),  # the allocation has them
    (["n1", "n2"], ["n1", "n2", "n3", "n4"], set(), 3, ["n3"], 0),
    (["n1", "n2"], ["n1", "n2"], set(), 4, [], 2),  # sbatch --nodes=2, grow to 4
    (["n1", "n2"], ["n1", "n2", "n3", "n4"], {"n3", "n4"}, 4, [], 2),  # grow after a shrink
    (["n1"], ["n1", "n2", "n3"], {"n3"}, 3, ["n2"], 1),  # part from the allocation, part companion
    (["n1", "n2"], ["n1", "n2"], set(), 2, [], 0),
])
def test_grow_choice(active, alloc, gone, want, take, missing) -> None:
    assert grow_choice(active, alloc, gone, want) == (take, missing)


def test_companion_timeout_option() -> None:
    args = build_parser().parse_args(["--nnodes", "1:2", "--companion-timeout", "7", "--", "python", "-c", "pass"])
    assert options_from_args(args).companion_timeout == 7.0
    args = build_parser().parse_args(["--nnodes", "1:2", "--", "python", "-c", "pass"])
    assert options_from_args(args).companion_timeout == 120.0


# ------------------------------------------------------------ mocked Slurm
class Slurm:
    """Scripted Slurm: job 5 runs on n1,n2 (batch host n1); companion jobs get ids from 17 on and
    answer `scontrol show job` with `states[job]` (a JobInfo-like text)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str | None]] = []
        self.states: dict[str, str] = {"5": "JobId=5 JobName=elastic-it JobState=RUNNING NodeList=n[1-2] "
                                            "BatchHost=n1 NumNodes=2 Partition=debug Reason=None"}
        self.next_id = 17

    def __call__(self, cmd, *, input=None, env=None, timeout=None):
        cmd = list(cmd)
        self.calls.append((cmd, input))
        ok = lambda out="": subprocess.CompletedProcess(cmd, 0, out, "")
        if cmd[0] == "sbatch":
            jid = str(self.next_id)
            self.next_id += 1
            self.states.setdefault(jid, f"JobId={jid} JobState=PENDING Reason=Resources NodeList= NumNodes=2")
            return ok(f"{jid}\n")
        if cmd[:3] == ["scontrol", "show", "job"]:
            if cmd[3] in self.states:
                return ok(self.states[cmd[3]])
            return subprocess.CompletedProcess(cmd, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
        if cmd[0] in ("scancel",) or cmd[:2] == ["scontrol", "update"]:
            return ok()
        return subprocess.CompletedProcess(cmd, 1, "", f"unexpected {cmd}\n")

    def commands(self, first: str) -> list[list[str]]:
        return [c for c, _ in self.calls if c[0] == first or c[:2] == first.split()]


@pytest.fixture
def slurm():
    return Slurm()


def make_launcher(slurm, tmp_path, timeout=0.3, gpn=2):
    commands = SlurmCommands(runner=slurm)
    backend = SlurmNodes(commands, 5, gpn, log_dir=tmp_path / "logs")
    store = Store(f"sqlite:///{tmp_path}/e.db", create=True)
    opts = Options(1, 4, gpn, [ParallelConfig.parse("pp4tp2"), ParallelConfig.parse("pp2tp2")], ["x"],
                   job_name="elastic-it", companion_timeout=timeout)
    la = Launcher(opts, backend, store, slurm_job_id="5", log=lambda m: None)
    la.job_id = store.create_job("elastic-it", "pp2tp2dp1", gpn, 4 * gpn, slurm_job_id="5", pinned_node="n1",
                                 nodes=["n1", "n2"])
    la.current = RankMap(ParallelConfig(pp=2, tp=2), (0, 1, 2, 3))
    la.handles = {"n1": None, "n2": None}
    return la, store


def test_companion_that_never_starts_is_cancelled_and_the_grow_fails(slurm, tmp_path) -> None:
    la, store = make_launcher(slurm, tmp_path)
    rid = store.add_request(la.job_id, "grow", {"nodes": 4}, "tester")
    (req,) = store.pending_requests(la.job_id)
    la.handle_request(req)
    (sbatch, script), = [(c, i) for c, i in slurm.calls if c[0] == "sbatch"]
    assert sbatch == ["sbatch", "--parsable", "--job-name=elastic-it-companion-1", "--partition=debug", "--nodes=2",
                      "--gres=gpu:2", "--ntasks-per-node=2", "--exclude=n[1-2]", "--no-requeue",
                      "--no-kill", "--comment=elastic-launch companion-of=5",
                      f"--output={tmp_path}/logs/companion-1-%j.out"]
    assert script == build_companion_script(5)
    assert slurm.commands("scancel") == [["scancel", "17"]]
    assert not slurm.commands("scontrol update"), "the job itself is not touched"
    done = next(r for r in store.list_requests(la.job_id) if r.id == rid)
    assert done.status == "failed"
    assert "companion job 17 did not start within 0 s" in done.message and "PENDING" in done.message
    (mig,) = store.recent_migrations(la.job_id)
    assert mig.status == "failed" and mig.trigger == "resize" and "companion job 17 did not start" in mig.error
    assert (mig.from_layout, mig.to_layout) == ("pp2tp2dp1", "pp4tp2dp1")
    assert la.active == ["n1", "n2"] and la.alloc == ["n1", "n2"] and la.backend.companion_jobs() == []
    assert any("companion job 17 cancelled" in a.result for a in store.audit_log(target=f"job:{la.job_id}"))


def test_companion_that_fails_at_once_is_reported(slurm, tmp_path) -> None:
    slurm.states["17"] = "JobId=17 JobState=FAILED Reason=BadConstraints NodeList= NumNodes=2"
    la, store = make_launcher(slurm, tmp_path, timeout=30)
    out = la.grow_to(4, "resize")
    assert not out.ok and out.message == "companion job 17 ended (FAILED) before it started"
    assert store.recent_migrations(la.job_id)[0].error == out.message


def test_running_companion_extends_the_topology_and_grows_onto_it(slurm, tmp_path, monkeypatch) -> None:
    slurm.states["17"] = ("JobId=17 JobName=elastic-it-companion-1 JobState=RUNNING NodeList=n[3-4] BatchHost=n3 "
                          "NumNodes=2 Reason=None")
    la, store = make_launcher(slurm, tmp_path, timeout=30)
    seen = {}

    def fake_migrate(target, trigger, failed=(), ready_timeout=None, note=""):
        seen.update(target=target, trigger=trigger, ready_timeout=ready_timeout, note=note)
        return Outcome(trigger, True, "ok")

    monkeypatch.setattr(la, "migrate_to", fake_migrate)
    out = la.grow_to(4, "resize")
    assert out.ok
    assert seen["target"] == ["n1", "n2", "n3", "n4"] and seen["note"] == " (companion job 17)"
    assert 29 <= seen["ready_timeout"] <= 30
    assert la.alloc == ["n1", "n2", "n3", "n4"] and la.index["n4"] == 3
    assert la.node_devices("n3") == [4, 5] and la.node_devices("n4") == [6, 7]
    assert la.backend.job_of("n3") == 17 and la.backend.job_of("n1") == 5
    assert la.backend.is_companion_batch("n3") and not la.backend.is_companion_batch("n4")
    assert {n.name: n.state for n in store.list_nodes(la.job_id)}["n4"] == "idle"
    assert not slurm.commands("scancel")
    # the steps on companion nodes run in the companion job
    (cmd,) = la.backend.commands_for_start("n4", 3, {"A": "1"}, ["prog"])
    assert cmd[:2] == ["srun", "--jobid=17"] and "ELASTIC_NODE_INDEX=3" in cmd and "--nodelist=n4" in cmd


def test_failed_grow_migration_cancels_the_companion(slurm, tmp_path, monkeypatch) -> None:
    slurm.states["17"] = "JobId=17 JobState=RUNNING NodeList=n[3-4] BatchHost=n3 NumNodes=2 Reason=None"
    la, store = make_launcher(slurm, tmp_path, timeout=30)
    monkeypatch.setattr(la, "migrate_to", lambda *a, **k: Outcome("resize", False, "workers did not register"))
    out = la.grow_to(4, "resize")
    assert not out.ok and out.message == "workers did not register (companion job 17 cancelled)"
    assert slurm.commands("scancel") == [["scancel", "17"]]
    states = {n.name: n.state for n in store.list_nodes(la.job_id)}
    assert states["n3"] == states["n4"] == "released"
    # the next grow does not count the cancelled companion's nodes as idle: it asks for a new companion
    assert grow_choice(la.active, la.alloc, la.gone, 4) == ([], 2)


def test_release_shrinks_or_cancels_the_right_job(slurm, tmp_path) -> None:
    backend = SlurmNodes(SlurmCommands(runner=slurm), 5, 2)
    backend.adopt_companion(17, ["n3", "n4"], "n3")
    backend.release(["n1", "n2", "n3"])  # one companion node goes: shrink the companion, keep its batch host
    assert slurm.commands("scontrol update") == [["scontrol", "update", "JobId=17", "NodeList=n3"]]
    backend.release(["n1", "n2"])  # the companion's last node goes: cancel it; the job itself is untouched
    assert slurm.commands("scancel") == [["scancel", "17"]]
    assert backend.companion_jobs() == [] and backend.job_of("n3") == 5
    backend.release(["n1"])  # a node of the job itself: scontrol update as before
    assert slurm.commands("scontrol update")[-1] == ["scontrol", "update", "JobId=5", "NodeList=n1"]


def test_keep_order_keeps_own_nodes_then_companion_batch_host(slurm, tmp_path) -> None:
    la = make_launcher(slurm, tmp_path)[0]
    la.backend.adopt_companion(17, ["n3", "n4"], "n4")
    la.alloc += ["n3", "n4"]
    la.index.update({"n3": 2, "n4": 3})
    la.handles = {n: None for n in la.alloc}
    la.current = RankMap(ParallelConfig(pp=4, tp=2), tuple(range(8)))
    from migrate.topology import Topology

    la.topology = Topology.grid(4, 2, names=la.alloc, pinned=("n1",))
    assert la._keep_order() == ["n1", "n2", "n4", "n3"]


def test_companion_step_env_drops_the_launchers_job_variables(tmp_path, monkeypatch) -> None:
    fake_srun = tmp_path / "srun"
    fake_srun.write_text("#!/bin/sh\necho \"job=${SLURM_JOB_ID:-none} conf=$SLURM_CONF args=$*\"\n")
    fake_srun.chmod(0o755)
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    commands = SlurmCommands(env={"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_CONF": "/x/slurm.conf"})
    info = JobInfo(5, "RUNNING", ["n1", "n2"], "n1", 2)
    backend = SlurmNodes(commands, 5, 2, info=info, log_dir=tmp_path)
    backend.adopt_companion(17, ["n3"], "n3")
    for node, index in (("n3", 2), ("n1", 0)):
        h = backend.start(node, index, {"K": "v"}, ["echo", "hi"])
        h.step.wait(timeout=10)
    text = (tmp_path / "step-n3.log").read_text()
    assert "job=none conf=/x/slurm.conf" in text and "--jobid=17" in text
    assert h.devices == [0, 1] and "job=5" in (tmp_path / "step-n1.log").read_text()
