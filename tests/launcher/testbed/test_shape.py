"""The testbed's shape, without starting it: the default configuration is byte-for-byte the one
every Slurm test was written against (golden files written by the testbed before shapes existed),
and an uneven shape adds per-node GPU counts and one partition per count."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.cli import main as elastic
from launcher.testbed.cluster import Testbed
from launcher.testbed.config import parse_gpus, uneven_partitions

from tests.paths import GOLDEN
ROOT = "/tmp/elastic-testbed"  # the goldens name the default root


def test_default_shape_writes_the_old_configuration_exactly() -> None:
    testbed = Testbed(ROOT)
    assert testbed.nodes == ("n1", "n2", "n3", "n4") and testbed.gpus == (4, 4, 4, 4)
    assert testbed._slurm_conf_text() == (GOLDEN / "testbed_slurm_conf_default.txt").read_text()
    assert testbed._gres_conf_text() == (GOLDEN / "testbed_gres_conf_default.txt").read_text()


def test_uneven_shape_has_gpus_per_node_and_a_partition_per_count() -> None:
    conf = Testbed(ROOT, gpus=(4, 4, 2, 2))._slurm_conf_text().splitlines()
    nodes = {line.split()[0]: line for line in conf if line.startswith("NodeName=")}
    assert [(n, line.split("Gres=")[1].split()[0]) for n, line in nodes.items()] == [
        ("NodeName=n1", "gpu:4"), ("NodeName=n2", "gpu:4"), ("NodeName=n3", "gpu:2"), ("NodeName=n4", "gpu:2")]
    assert len({line.split("Port=")[1].split()[0] for line in nodes.values()}) == 4  # one slurmd port each
    parts = [line.split()[:2] for line in conf if line.startswith("PartitionName=")]
    assert parts == [["PartitionName=debug", "Nodes=n[1-4]"], ["PartitionName=gpu4", "Nodes=n1,n2"],
                     ["PartitionName=gpu2", "Nodes=n3,n4"]]
    gres = Testbed(ROOT, gpus=(4, 1))._gres_conf_text()
    assert f"NodeName=n2 Name=gpu File={ROOT}/dev/n2/nvidia0\n" in gres


def test_partitions_only_for_uneven_shapes() -> None:
    assert uneven_partitions((4, 4, 4, 4)) == {}
    assert uneven_partitions((2, 4, 2)) == {"gpu4": ["n2"], "gpu2": ["n1", "n3"]}


@pytest.mark.parametrize("text", ["", "4,,2", "4,x", "0,4", "9", ",".join(["1"] * 17)])
def test_bad_gpus_is_one_line_error(text: str) -> None:
    with pytest.raises(ValueError, match="--gpus") as exc:
        parse_gpus(text)
    assert "\n" not in str(exc.value)


def test_cli_refuses_gpus_outside_up(tmp_path, capsys) -> None:
    assert elastic(["testbed", "status", "--gpus", "4,2", "--root", str(tmp_path)]) == 2
    assert "--gpus applies to `up` only" in capsys.readouterr().err
    assert elastic(["testbed", "up", "--gpus", "4,x", "--root", str(tmp_path)]) == 2


def test_as_running_reads_the_shape_only_when_the_configuration_matches(tmp_path) -> None:
    uneven = Testbed(tmp_path, gpus=(4, 4, 2, 2))
    (tmp_path / "etc").mkdir()
    uneven.slurm_conf.write_text(uneven._slurm_conf_text())
    (tmp_path / "etc" / "gres.conf").write_text(uneven._gres_conf_text())
    (tmp_path / "etc" / "shape").write_text("4,4,2,2\n")
    assert Testbed.as_running(tmp_path).gpus == (4, 4, 2, 2)
    uneven.slurm_conf.write_text(Testbed(tmp_path)._slurm_conf_text())  # rewritten by a default up
    assert Testbed.as_running(tmp_path).gpus == (4, 4, 4, 4)


def test_daemons_do_not_inherit_descriptors(tmp_path) -> None:
    """`flock /tmp/elastic-slurm.lock elastic testbed up` passes the lock's descriptor down: a daemon
    that kept it would hold the team's lock as long as the testbed runs. Spawned daemons get 0-2 only."""
    import os
    import time

    from launcher.testbed.daemons import Daemon

    testbed = Testbed(tmp_path, verbose=False)
    for sub in ("log", "run"):
        (tmp_path / sub).mkdir()
    held = os.open(tmp_path / "lock", os.O_CREAT | os.O_RDWR)
    os.set_inheritable(held, True)  # as flock(1) hands it to its command
    pid = testbed._spawn(Daemon("probe", ["sleep", "30"], "sleep"))
    try:
        deadline = time.monotonic() + 60  # a loaded machine may take a while to exec
        while os.readlink(f"/proc/{pid}/exe") != _exe("sleep") and time.monotonic() < deadline:
            time.sleep(0.02)  # until exec replaced the child (before it, the spawn's own descriptors show)
        assert os.readlink(f"/proc/{pid}/exe") == _exe("sleep")
        # what it holds: stdin, the log twice, and nothing of ours (another thread of this process
        # may open a descriptor of its own between the listing and the spawn; the lock must never pass)
        held_by_daemon = _descriptors(pid)
        assert {"0", "1", "2"} <= set(held_by_daemon)
        assert str(tmp_path / "lock") not in held_by_daemon.values(), held_by_daemon
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(held)


def _descriptors(pid: int) -> dict[str, str]:
    """What process `pid` holds open, by descriptor. A descriptor closed between the listing and its
    readlink is left out: `sleep` opens and closes its locale files as it starts (a CI run caught fd 3 so),
    while an inherited lock stays open for the daemon's life, so it cannot slip through this way."""
    held = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            pass
    return held


def _exe(name: str) -> str:
    from launcher.testbed.daemons import real_exe

    return real_exe(name)


@pytest.mark.parametrize("release, ctld, first_slurmd", [("22.05", 26817, 26901), ("24.11", 27817, 27901),
                                                         ("26.05", 28817, 28901)])
def test_each_release_has_ports_of_its_own_and_what_it_needs(release, ctld, first_slurmd) -> None:
    from launcher.testbed.config import cgroup_conf_text, has_accounting, slurm_conf_text

    conf = slurm_conf_text(Path(ROOT), (4, 4), release)
    assert f"SlurmctldPort={ctld}\n" in conf and f"Port={first_slurmd}-{first_slurmd + 1} " in conf
    newer = release != "22.05"
    assert ("AccountingStorageType=accounting_storage/none" in conf) == newer == (not has_accounting(release))
    assert (cgroup_conf_text(release) or "").endswith("CgroupPlugin=disabled\n") == newer
    limited = slurm_conf_text(Path(ROOT), (4, 4), release, "rl_bucket_size=4")
    assert limited == conf + "SlurmctldParameters=rl_enable,rl_bucket_size=4\n"


def test_testbed_cli_errors_and_run_on_the_host(tmp_path) -> None:
    import subprocess
    import sys

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "launcher.cli", "testbed", *argv], capture_output=True,
                              text=True, timeout=60)

    ran = cli("run", "--", "sh", "-c", "echo ran $0", "there")
    assert ran.returncode == 0 and ran.stdout.strip() == "ran there", ran.stderr
    assert "argument --slurm: invalid choice: '99.99'" in cli("status", "--slurm", "99.99").stderr
    none = cli("run", "--slurm", "22.05")
    assert none.returncode == 2 and "give the command to run after --" in none.stderr
    assert "takes no command" in cli("status", "extra", "words").stderr
