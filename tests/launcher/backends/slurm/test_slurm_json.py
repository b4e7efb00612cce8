"""The JSON readers on what real slurmctld of each release printed.

tests/launcher/golden/slurm/<release>/ is written by scripts/capture-slurm-output.py on the testbed of
that release (a plain 2-node job with 2 GPUs a node, a heterogeneous job of 1 + 3 GPUs, a job that
waits for 4 whole nodes). The oracle for the JSON is what the same daemons printed as text
(`scontrol show -d job`, read by a parser of its own) and the jobs the script submitted.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.backends.slurm.allocation import parse_show_job_detail, parse_squeue_allocation
from launcher.backends.slurm.client import SlurmCommands
from launcher.backends.slurm.parse import parse_scontrol_show_job, parse_sinfo_json, parse_squeue_json
from launcher.backends.slurm.slurm_json import SlurmFormatError, json_format, node_records
from dashboard.slurm_reader import SlurmReadError, parse_squeue
from tests.launcher.backends.slurm.test_client import ScriptedRunner

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "slurm"
RELEASES = sorted(p.name for p in GOLDEN.iterdir() if p.is_dir())


def _files(release: str, kind: str) -> list[Path]:
    """The plain `--json` output and every named format of the release."""
    return sorted((GOLDEN / release).glob(f"{kind}*.json"))


def test_every_release_the_testbed_runs_was_captured() -> None:
    assert RELEASES == ["22.05", "24.11", "26.05"]


@pytest.mark.parametrize("release", RELEASES)
def test_squeue_of_each_release_and_format_reads_the_jobs_submitted(release: str) -> None:
    ids = json.loads((GOLDEN / release / "jobs.json").read_text())
    for path in _files(release, "squeue"):
        jobs = {j.job_id: j for j in parse_squeue_json(path.read_text())}
        plain, pending = jobs[ids["plain"]], jobs[ids["pending"]]
        assert (plain.state, plain.nodes, plain.num_nodes, plain.batch_host) == ("RUNNING", ["n1", "n2"], 2, "n1"), path
        assert (pending.state, pending.num_nodes, pending.nodes, pending.comment) == \
            ("PENDING", 4, [], "elastic:waits"), path
        assert pending.reason in ("Resources", "Priority"), path
        assert pending.submit_time >= plain.submit_time > 1_700_000_000, path
        assert plain.priority > 0, path


@pytest.mark.parametrize("release", RELEASES)
def test_allocations_from_squeue_equal_what_scontrol_printed(release: str) -> None:
    ids = json.loads((GOLDEN / release / "jobs.json").read_text())
    for name in ("plain", "het"):
        text_view = parse_show_job_detail((GOLDEN / release / f"show_job_{name}.txt").read_text())
        for path in _files(release, "squeue"):
            assert parse_squeue_allocation(path.read_text(), ids[name]) == text_view, (path, name)
    het = parse_show_job_detail((GOLDEN / release / "show_job_het.txt").read_text())
    assert [c.gpus for c in het.components] == [(1,), (3,)]


@pytest.mark.parametrize("release", RELEASES)
def test_sinfo_of_each_release_and_format_lists_every_node_once(release: str) -> None:
    for path in _files(release, "sinfo"):
        nodes = parse_sinfo_json(path.read_text())
        assert [n.name for n in nodes] == ["n1", "n2", "n3", "n4"], path
        assert all((n.cpus, n.gres, n.partitions) == (4, "gpu:4", ["debug"]) for n in nodes), path
        states = {n.name: n.state for n in nodes}
        assert states["n4"] == "idle" and states["n1"] in ("mixed", "allocated"), path


@pytest.mark.parametrize("release", RELEASES)
def test_the_dashboard_reads_the_same_gpus_as_scontrol_shows(release: str) -> None:
    ids = json.loads((GOLDEN / release / "jobs.json").read_text())
    for path in _files(release, "squeue"):
        jobs = {j.job_id: j for j in parse_squeue(path.read_text())}
        assert str(ids["pending"]) not in jobs  # holds nothing
        assert jobs[str(ids["plain"])].gpus == {"n1": (0, 1), "n2": (0, 1)}, path
        parts = [j for j in jobs.values() if j.het_job_id == str(ids["het"])]
        assert sorted(sum(len(v) for v in j.gpus.values()) for j in parts) == [1, 3], path


@pytest.mark.parametrize("release", RELEASES)
def test_scontrol_show_job_of_each_release(release: str) -> None:
    ids = json.loads((GOLDEN / release / "jobs.json").read_text())
    info = parse_scontrol_show_job((GOLDEN / release / "show_job_plain.txt").read_text())
    assert (info.job_id, info.state, info.nodes, info.batch_host, info.num_nodes) == \
        (ids["plain"], "RUNNING", ["n1", "n2"], "n1", 2)
    assert info.user_id == 0  # scripts/capture-slurm-output.py submits as root (the service checks owners by it)


def _shape(release: str, kind: str) -> dict:
    return json.loads((GOLDEN / release / f"{kind}.json").read_text())


def test_a_field_of_an_unknown_shape_names_the_release_and_the_field() -> None:
    data = _shape("26.05", "squeue")
    data["jobs"][0]["node_count"] = [2]
    with pytest.raises(SlurmFormatError, match=r"Slurm 26\.05\.5: field jobs\[0\]\.node_count is '\[2\]'"):
        parse_squeue_json(json.dumps(data))
    data = _shape("24.11", "sinfo")
    del data["sinfo"]
    with pytest.raises(SlurmFormatError, match=r"Slurm 24\.11\.5: field sinfo is 'missing"):
        node_records(json.dumps(data))
    data = _shape("24.11", "sinfo")
    data["sinfo"][0]["nodes"]["nodes"] = 7
    with pytest.raises(SlurmFormatError, match=r"Slurm 24\.11\.5: field sinfo\[0\]\.nodes\.nodes is '7'"):
        node_records(json.dumps(data))
    data = _shape("24.11", "squeue")
    data["jobs"][0]["job_state"] = {"current": "RUNNING"}
    with pytest.raises(SlurmReadError, match=r"Slurm 24\.11\.5: field jobs\[0\]\.job_state"):
        parse_squeue(json.dumps(data))


def test_an_error_slurm_reports_in_its_json_is_said() -> None:
    data = _shape("26.05", "squeue")
    data["errors"] = [{"description": "Unable to contact slurm controller", "error_number": 1}]
    with pytest.raises(SlurmFormatError, match="Slurm 26.05.5 reported: Unable to contact slurm controller"):
        parse_squeue_json(json.dumps(data))


@pytest.mark.parametrize("release, fmt", [
    ((22, 5), None), ((23, 2), "v0.0.39"), ((23, 11), "v0.0.40"), ((24, 5), "v0.0.41"), ((24, 11), "v0.0.42"),
    ((25, 11), "v0.0.42"), ((26, 5), "v0.0.42"),
])
def test_the_format_asked_for_is_one_the_release_offers(release, fmt) -> None:
    assert json_format(release) == fmt


@pytest.mark.parametrize("release", RELEASES)
def test_the_named_format_is_one_the_captured_release_listed(release: str) -> None:
    """The formats each release listed (`squeue --json=list`, captured as files) include the one asked for."""
    major, minor = (int(p) for p in release.split("."))
    fmt = json_format((major, minor))
    offered = {p.stem.split("-", 1)[1] for p in _files(release, "squeue") if "-" in p.stem}
    assert fmt is None and not offered or fmt in offered


@pytest.mark.parametrize("version, asked", [("slurm-wlm 22.05.8\n", "--json"), ("slurm 24.11.5\n", "--json=v0.0.42"),
                                            ("slurm-wlm 26.05.5\n", "--json=v0.0.42")])
def test_the_client_reads_the_release_once_and_asks_for_its_format(version: str, asked: str) -> None:
    release = "26.05" if "26" in version else "24.11" if "24" in version else "22.05"
    runner = ScriptedRunner({("scontrol", "--version"): (0, version, ""),
                             ("squeue",): (0, (GOLDEN / release / "squeue.json").read_text(), ""),
                             ("sinfo",): (0, (GOLDEN / release / "sinfo.json").read_text(), "")})
    slurm = SlurmCommands(runner=runner)
    assert len(slurm.jobs()) == 4 and len(slurm.nodes()) == 4 and len(slurm.jobs()) == 4
    commands = [c[0] for c in runner.calls]
    assert commands.count(["scontrol", "--version"]) == 1
    assert ["squeue", asked] in commands and ["sinfo", asked] in commands


def test_the_routine_looks_share_one_read_and_slow_down_while_slurmctld_is_slow(monkeypatch) -> None:
    """Node health, drains and the policy's partition each ask within 30 s: Slurm is asked once. An answer
    that took seconds (Slurm's RPC rate limit makes the client wait and retry, it does not fail) makes the
    launcher say so and read half as often; a prompt one brings the pace back."""
    from launcher.backends.slurm import client as client_module

    clock = [0.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: clock[0])
    slow = {"squeue": 0.0}

    def runner(cmd, *, input=None, env=None, timeout=None):
        clock[0] += slow.get(cmd[0], 0.0)
        return ScriptedRunner({("scontrol", "--version"): (0, "slurm 26.05.5\n", ""),
                               ("squeue",): (0, (GOLDEN / "26.05" / "squeue.json").read_text(), ""),
                               ("sinfo", "--noheader"): (0, "n1 mixed*\n", ""),
                               ("sinfo",): (0, (GOLDEN / "26.05" / "sinfo.json").read_text(), "")})(cmd)

    calls: list[str] = []
    said: list[str] = []
    slurm = SlurmCommands(runner=lambda cmd, **kw: calls.append(cmd[0]) or runner(cmd, **kw))
    slurm.say = said.append
    assert slurm.node_states(["n1", "n4"], max_age=30) == {"n1": ("mixed", True), "n4": ("idle", True)}
    clock[0] += 10
    assert len(slurm.nodes(max_age=30)) == 4 and len(slurm.jobs(max_age=30)) == 4
    assert calls.count("sinfo") == 1 and calls.count("squeue") == 1
    clock[0] += 25  # the node read is 35 s old: asked again
    slurm.nodes(max_age=30)
    assert calls.count("sinfo") == 2
    slow["squeue"] = 6.0
    clock[0] += 31
    slurm.jobs(max_age=30)
    assert slurm.backoff == 2 and "took 6.0 s to answer `squeue" in said[-1] and "training goes on" in said[-1]
    slow["squeue"] = 0.0
    clock[0] += 20  # both reads younger than 2 x 30 s: no new read
    slurm.jobs(max_age=30), slurm.nodes(max_age=30)
    assert calls.count("squeue") == 2 and calls.count("sinfo") == 2
    clock[0] += 30
    slurm.nodes(max_age=30)
    assert slurm.backoff == 1 and "promptly again" in said[-1]
    assert slurm.node_states(["n1"]) == {"n1": ("mixed", False)}  # a look that needs it now asks now (sinfo %T)
