"""Unit tests for launcher.backends.slurm.client (and the pyslurm client against a stand-in): no Slurm needed.

Command builders are compared with golden files (one argv item per line, so a
diff shows exactly which flag changed); parsers run on outputs captured from
the real testbed (tests/launcher/golden/); error handling runs against a
scripted runner. Regenerate the command goldens with UPDATE_GOLDEN=1.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

from launcher.backends.slurm.pyslurm import PyslurmBackend
from launcher.backends.slurm.client import SlurmClient, SlurmCommands, SlurmError
from launcher.backends.slurm.commands import (
    build_cancel_command,
    build_sbatch_command,
    build_show_job_command,
    build_shrink_command,
    build_signal_command,
    build_sinfo_command,
    build_squeue_command,
    build_srun_command,
)
from launcher.backends.slurm.hostlist import compress_hostlist, expand_hostlist
from launcher.backends.slurm.parse import (
    JobInfo,
    parse_sbatch_output,
    parse_scontrol_show_job,
    parse_sinfo_json,
    parse_slurm_version,
    parse_squeue_json,
)
from launcher.backends.slurm.select import select_backend

from tests.paths import GOLDEN

COMMAND_CASES: dict[str, Callable[[], list[str]]] = {
    "cmd_srun_two_nodes_overlap": lambda: build_srun_command(
        42, ["n1", "n2"], 1, 4, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        ["python", "-m", "train", "--steps=10"]),
    "cmd_srun_no_overlap_no_gpus_no_env": lambda: build_srun_command(
        7, ["n3"], 2, 0, {}, ["hostname"], overlap=False),
    "cmd_srun_env_with_commas": lambda: build_srun_command(
        9, ["n1", "n2", "n3", "n4"], 1, 2, {"LAYOUT": "pp=2,tp=2", "A": "x y"}, ["bash", "-c", "echo $LAYOUT"]),
    "cmd_shrink_to_two": lambda: build_shrink_command(42, ["n1", "n2"]),
    "cmd_shrink_to_one": lambda: build_shrink_command(42, ["n1"]),
    "cmd_shrink_gappy": lambda: build_shrink_command("42", ["n1", "n3", "n4"]),
    "cmd_show_job": lambda: build_show_job_command(42),
    "cmd_squeue_all": lambda: build_squeue_command(),
    "cmd_squeue_some": lambda: build_squeue_command([42, 43]),
    "cmd_sinfo": lambda: build_sinfo_command(),
    "cmd_sbatch_stdin": lambda: build_sbatch_command(None, ["--nodes=4", "--gres=gpu:4"]),
    "cmd_sbatch_path": lambda: build_sbatch_command(Path("/tmp/job.sh")),
    "cmd_cancel": lambda: build_cancel_command(42),
    "cmd_signal_steps": lambda: build_signal_command(42, signal.SIGUSR1),
    "cmd_signal_batch": lambda: build_signal_command(42, "SIGTERM", batch=True),
}


@pytest.mark.parametrize("name", sorted(COMMAND_CASES))
def test_command_matches_golden(name: str) -> None:
    built = COMMAND_CASES[name]()
    assert all(isinstance(part, str) for part in built)
    path = GOLDEN / f"{name}.txt"
    text = "\n".join(built) + "\n"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text()


def test_srun_env_goes_through_env_program_so_commas_survive() -> None:
    cmd = build_srun_command(1, ["n1"], 1, 0, {"X": "a,b"}, ["prog"])
    assert cmd[cmd.index("env") + 1] == "X=a,b"
    assert cmd[-1] == "prog"


@pytest.mark.parametrize("kwargs, words", [
    ({"nodes": []}, "nodes is empty"),
    ({"ntasks_per_node": 0}, "ntasks_per_node"),
    ({"gpus_per_node": -1}, "gpus_per_node"),
    ({"argv": []}, "argv is empty"),
    ({"env": {"BAD-NAME": "1"}}, "not a valid shell name"),
])
def test_srun_builder_rejects_bad_input(kwargs: dict, words: str) -> None:
    args = {"job_id": 1, "nodes": ["n1"], "ntasks_per_node": 1, "gpus_per_node": 0,
            "env": {}, "argv": ["x"]}
    args.update(kwargs)
    with pytest.raises(ValueError, match=words):
        build_srun_command(**args)


def test_shrink_builder_rejects_empty() -> None:
    with pytest.raises(ValueError, match="cancel the job instead"):
        build_shrink_command(1, [])


# ---------------------------------------------------------------- hostlists
@pytest.mark.parametrize("expr, hosts", [
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1,3-4]", ["n1", "n3", "n4"]),
    ("n1", ["n1"]),
    ("n1,n2", ["n1", "n2"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("a[1-2],b[5],c", ["a1", "a2", "b5", "c"]),
    ("rack1-n[1-2]", ["rack1-n1", "rack1-n2"]),
    ("", []),
    ("(null)", []),
])
def test_expand_hostlist(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("hosts, expr", [
    (["n1", "n2", "n3"], "n[1-3]"),
    (["n3", "n1", "n2"], "n[1-3]"),
    (["n1", "n3", "n4"], "n[1,3-4]"),
    (["n1"], "n1"),
    (["n1", "n1"], "n1"),
    (["gpu08", "gpu09", "gpu10"], "gpu[08-10]"),
    (["login", "n1", "n2"], "login,n[1-2]"),
])
def test_compress_hostlist(hosts: list[str], expr: str) -> None:
    assert compress_hostlist(hosts) == expr


@pytest.mark.parametrize("hosts", [["n1", "n2", "n4", "n7", "n8", "n9"], ["x01", "x02"], ["solo"]])
def test_hostlist_round_trip(hosts: list[str]) -> None:
    assert expand_hostlist(compress_hostlist(hosts)) == hosts


def test_expand_hostlist_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        expand_hostlist("n[a-b]")


# ------------------------------------------------------------------ parsers
def _golden(name: str) -> str:
    return (GOLDEN / name).read_text()


def test_parse_scontrol_running_job() -> None:
    info = parse_scontrol_show_job(_golden("scontrol_show_job_running_4.txt"))
    assert info == JobInfo(job_id=2, state="RUNNING", nodes=["n1", "n2", "n3", "n4"],
                           batch_host="n1", num_nodes=4, name="elastic-golden", reason="None")


def test_parse_scontrol_shrunk_job() -> None:
    info = parse_scontrol_show_job(_golden("scontrol_show_job_shrunk_2.txt"))
    assert (info.nodes, info.num_nodes, info.batch_host) == (["n1", "n3"], 2, "n1")


def test_parse_scontrol_pending_job() -> None:
    info = parse_scontrol_show_job(_golden("scontrol_show_job_pending.txt"))
    assert (info.state, info.nodes, info.batch_host, info.reason) == ("PENDING", [], None, "Resources")
    assert info.num_nodes == 4


def test_parse_scontrol_one_line_form() -> None:
    one_line = " ".join(_golden("scontrol_show_job_running_4.txt").split())
    assert parse_scontrol_show_job(one_line).nodes == ["n1", "n2", "n3", "n4"]


def test_parse_scontrol_rejects_non_job_text() -> None:
    with pytest.raises(ValueError, match="no JobId"):
        parse_scontrol_show_job(_golden("scontrol_show_job_stderr_invalid_id.txt"))


def test_parse_squeue_json() -> None:
    jobs = {j.job_id: j for j in parse_squeue_json(_golden("squeue.json"))}
    assert jobs[2] == JobInfo(2, "RUNNING", ["n1", "n2", "n3", "n4"], "n1", 4, "elastic-golden", "None")
    assert (jobs[3].state, jobs[3].nodes, jobs[3].batch_host, jobs[3].reason) == ("PENDING", [], None, "Resources")
    # what the policy orders elastic jobs by (launcher.policy.peers): read from Slurm's own record
    assert (jobs[2].priority, jobs[2].submit_time, jobs[2].comment) == (4294901758, 1795960536, "")


def test_parse_squeue_json_rejects_non_json() -> None:
    with pytest.raises(ValueError, match="did not print JSON"):
        parse_squeue_json("squeue: error: ...")


def test_parse_sinfo_json() -> None:
    nodes = parse_sinfo_json(_golden("sinfo.json"))
    assert [n.name for n in nodes] == ["n1", "n2", "n3", "n4"]
    assert all(n.gres == "gpu:4" and n.cpus == 4 and n.partitions == ["debug"] for n in nodes)


def test_parse_sbatch_and_version() -> None:
    assert parse_sbatch_output("17\n") == 17
    assert parse_sbatch_output("17;elastic\n") == 17
    with pytest.raises(ValueError):
        parse_sbatch_output("")
    assert parse_slurm_version("slurm-wlm 22.05.8") == (22, 5)
    assert parse_slurm_version("22.5.1") == (22, 5)


# -------------------------------------------------- running, mocked runner
class ScriptedRunner:
    """Stands in for subprocess: answers by the command's first words, records calls."""

    def __init__(self, answers: dict[tuple[str, ...], tuple[int, str, str] | Exception]) -> None:
        # the release the client reads once before its first squeue/sinfo: 22.05 unless a test says otherwise
        self.answers = {("scontrol", "--version"): (0, "slurm-wlm 22.05.8\n", ""), **answers}
        self.calls: list[tuple[list[str], str | None, dict]] = []

    def __call__(self, cmd, *, input=None, env=None, timeout=None):
        self.calls.append((list(cmd), input, dict(env or {})))
        for prefix, answer in self.answers.items():
            if tuple(cmd[: len(prefix)]) == prefix:
                if isinstance(answer, Exception):
                    raise answer
                rc, out, err = answer
                return subprocess.CompletedProcess(cmd, rc, out, err)
        raise AssertionError(f"unexpected command {cmd}")


def test_job_info_runs_scontrol_with_slurm_conf() -> None:
    runner = ScriptedRunner({("scontrol", "show"): (0, _golden("scontrol_show_job_running_4.txt"), "")})
    backend = SlurmCommands(env={"SLURM_CONF": "/x/slurm.conf"}, runner=runner)
    assert backend.job_info(2).batch_host == "n1"
    cmd, _, env = runner.calls[0]
    assert cmd == ["scontrol", "show", "job", "2"] and env["SLURM_CONF"] == "/x/slurm.conf"


def test_job_info_error_says_what_and_what_to_do() -> None:
    runner = ScriptedRunner({("scontrol", "show"): (1, "", _golden("scontrol_show_job_stderr_invalid_id.txt"))})
    with pytest.raises(SlurmError) as exc:
        SlurmCommands(runner=runner).job_info(99999)
    msg = str(exc.value)
    assert "reading job 99999 failed" in msg and "Invalid job id specified" in msg and "squeue" in msg
    assert exc.value.returncode == 1


def test_shrink_failure_explains_batch_host() -> None:
    runner = ScriptedRunner({
        ("scontrol", "update"): (1, "", _golden("scontrol_update_stderr_without_batch_host.txt")),
        ("scontrol", "show"): (0, _golden("scontrol_show_job_running_4.txt"), ""),
    })
    with pytest.raises(SlurmError) as exc:
        SlurmCommands(runner=runner).shrink(2, ["n2", "n3"])
    msg = str(exc.value)
    assert "shrinking job 2 to n[2-3] failed" in msg
    assert "Invalid node name specified" in msg
    assert "batch host n1 is not kept" in msg
    assert runner.calls[0][0] == ["scontrol", "update", "JobId=2", "NodeList=n[2-3]"]


def test_shrink_success_runs_one_command() -> None:
    runner = ScriptedRunner({("scontrol", "update"): (0, "", "")})
    SlurmCommands(runner=runner).shrink(2, ["n1", "n2"])
    assert [c[0] for c in runner.calls] == [["scontrol", "update", "JobId=2", "NodeList=n[1-2]"]]


def test_missing_binary_and_timeout_become_slurm_errors() -> None:
    missing = SlurmCommands(runner=ScriptedRunner({("sinfo",): FileNotFoundError("sinfo")}))
    with pytest.raises(SlurmError, match="not installed or not on PATH"):
        missing.nodes()
    slow = SlurmCommands(runner=ScriptedRunner({("squeue",): subprocess.TimeoutExpired("squeue", 30)}))
    with pytest.raises(SlurmError, match="did not answer .*scontrol ping"):
        slow.jobs()


def test_submit_text_goes_on_stdin_and_path_as_argument(tmp_path: Path) -> None:
    runner = ScriptedRunner({("sbatch",): (0, "5\n", "")})
    backend = SlurmCommands(runner=runner)
    assert backend.submit("#!/bin/bash\nsleep 1\n", env={"FOO": "1"}, extra_args=["--nodes=2"]) == 5
    cmd, stdin, env = runner.calls[0]
    assert cmd == ["sbatch", "--parsable", "--nodes=2"] and stdin.startswith("#!") and env["FOO"] == "1"
    script = tmp_path / "job.sh"
    backend.submit(script)
    assert runner.calls[1][0] == ["sbatch", "--parsable", str(script)] and runner.calls[1][1] is None


def test_submit_error_carries_slurm_message() -> None:
    runner = ScriptedRunner({("sbatch",): (1, "", _golden("sbatch_stderr_too_many_gpus.txt"))})
    with pytest.raises(SlurmError, match="submitting a batch job failed: .*node configuration is not available.*sinfo"):
        SlurmCommands(runner=runner).submit("#!/bin/bash\n")


def test_signal_and_cancel_commands() -> None:
    runner = ScriptedRunner({("scancel",): (0, "", "")})
    backend = SlurmCommands(runner=runner)
    backend.signal(3, signal.SIGUSR1)
    backend.signal(3, "TERM", batch=True)
    backend.cancel(3)
    assert [c[0] for c in runner.calls] == [
        ["scancel", "--signal=USR1", "3"], ["scancel", "--signal=TERM", "--batch", "3"], ["scancel", "3"]]


def test_start_step_runs_the_built_command(tmp_path: Path) -> None:
    fake_srun = tmp_path / "srun"
    fake_srun.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake_srun.chmod(0o755)
    backend = SlurmCommands(env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    proc = backend.start_step(4, ["n1", "n2"], 1, 2, {"K": "v"}, ["echo", "hi"],
                              stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=10)
    assert out.splitlines() == build_srun_command(4, ["n1", "n2"], 1, 2, {"K": "v"}, ["echo", "hi"])[1:]


# ---------------------------------------------------------- backend choice
def _version_runner(text: str) -> ScriptedRunner:
    return ScriptedRunner({("scontrol", "--version"): (0, text, "")})


def _importer(module: object | None) -> Callable[[str], object]:
    def load(name: str) -> object:
        if module is None:
            raise ImportError(name)
        return module
    return load


def test_select_backend_without_pyslurm_uses_commands() -> None:
    backend = select_backend(runner=_version_runner("slurm-wlm 22.05.8\n"), importer=_importer(None))
    assert type(backend) is SlurmCommands and isinstance(backend, SlurmClient)


def test_select_backend_with_mismatched_pyslurm_uses_commands() -> None:
    fake = SimpleNamespace(__version__="25.11.0")
    backend = select_backend(runner=_version_runner("slurm-wlm 22.05.8\n"), importer=_importer(fake))
    assert type(backend) is SlurmCommands


def test_select_backend_with_matching_pyslurm() -> None:
    fake = SimpleNamespace(__version__="22.5.1")
    backend = select_backend(runner=_version_runner("slurm-wlm 22.05.8\n"), importer=_importer(fake))
    assert isinstance(backend, PyslurmBackend) and isinstance(backend, SlurmClient)


def test_pyslurm_backend_shrinks_through_required_nodes() -> None:
    calls: list[tuple] = []

    class FakeJob:
        def __init__(self, job_id: int) -> None:
            self.job_id = job_id

        def modify(self, changes) -> None:
            calls.append(("modify", self.job_id, changes.kwargs))

    class FakeDesc:
        def __init__(self, **kwargs) -> None:
            self.kwargs = kwargs

    fake = SimpleNamespace(Job=FakeJob, JobSubmitDescription=FakeDesc)
    PyslurmBackend(fake).shrink(8, ["n1", "n2"])
    assert calls == [("modify", 8, {"required_nodes": "n[1-2]"})]


def test_pyslurm_errors_become_slurm_errors() -> None:
    class Boom:
        @staticmethod
        def load(job_id: int):
            raise RuntimeError("Invalid job id specified")

    with pytest.raises(SlurmError, match="reading job 5 failed .pyslurm.: Invalid job id"):
        PyslurmBackend(SimpleNamespace(Job=Boom)).job_info(5)



def test_pyslurm_job_info_keeps_the_partition() -> None:
    """Companion jobs are submitted to the job's partition, so job_info must carry it (stand-in pyslurm)."""
    job = SimpleNamespace(id=7, state="RUNNING", allocated_nodes="n[1-2]", batch_host="n1", num_nodes=2,
                          name="train", state_reason="None", partition="gpu")
    info = PyslurmBackend(SimpleNamespace(Job=SimpleNamespace(load=lambda job_id: job))).job_info(7)
    assert (info.partition, info.nodes, info.batch_host) == ("gpu", ["n1", "n2"], "n1")


def test_a_read_that_timed_out_is_asked_once_more_and_a_change_is_not() -> None:
    """Under Slurm's RPC rate limit a burst of requests waits its turn: a read (safe to repeat) gets a second
    try with twice the time, said in one line; a change (scontrol update) is never sent twice."""
    answers = iter([subprocess.TimeoutExpired("scontrol", 30), subprocess.CompletedProcess([], 0,
                    _golden("scontrol_show_job_running_4.txt"), "")])
    timeouts: list[float] = []

    def runner(cmd, *, input=None, env=None, timeout=None):
        timeouts.append(timeout)
        got = next(answers)
        if isinstance(got, Exception):
            raise got
        return got

    said: list[str] = []
    slurm = SlurmCommands(runner=runner)
    slurm.say = said.append
    assert slurm.job_info(4).state == "RUNNING"
    assert timeouts == [30.0, 60.0] and "asking again, for up to 60 s" in said[0]
    update = ScriptedRunner({("scontrol", "update"): subprocess.TimeoutExpired("scontrol", 30),
                             ("scontrol", "show"): (0, _golden("scontrol_show_job_running_4.txt"), "")})
    with pytest.raises(SlurmError, match="did not answer within 30 s"):
        SlurmCommands(runner=update).shrink(4, ["n1"])
    assert [c[0][:2] for c in update.calls].count(["scontrol", "update"]) == 1
