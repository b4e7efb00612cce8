"""SQLite on a network filesystem is refused before anything is written (db.fs, db.engine)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from db import DatabaseError, Store
from db.fs import fstype_of, is_network_fstype, mount_fstype
from launcher.cli import main

# A compute node as clusters set them up: NFS home, Lustre scratch, GPFS projects, local /tmp,
# a FUSE sshfs mount, an SMB share with a space in its mount point, and an NFS mount later
# hidden by a tmpfs mounted on the same directory.
MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
23 22 0:21 / /proc rw,nosuid shared:12 - proc proc rw
30 22 0:40 / /home rw,relatime shared:20 - nfs4 fs1:/export/home rw,vers=4.2
31 22 0:41 / /scratch rw,relatime shared:21 - lustre 10.0.0.1@o2ib:/scratch rw,flock
32 22 0:42 / /gpfs/projects rw,relatime shared:22 - gpfs projects rw
33 22 0:43 / /tmp rw,nosuid,nodev shared:23 - tmpfs tmpfs rw
34 30 0:44 / /home/alice/remote rw,relatime shared:24 - fuse.sshfs alice@login:/data rw
35 22 0:45 / /mnt/team\\040share rw,relatime shared:25 - cifs //nas/team rw
36 22 0:46 / /mnt/cache rw,relatime shared:26 - nfs nas:/cache rw
37 22 0:47 / /mnt/cache rw,relatime shared:27 - tmpfs tmpfs rw
38 22 0:48 / /mnt/lxc rw,relatime - fuse.lxcfs lxcfs rw
39 22 0:49 / /ceph rw,relatime - ceph 10.0.0.2:/ rw
"""


@pytest.mark.parametrize("directory, fstype", [
    ("/home/alice", "nfs4"),
    ("/home", "nfs4"),
    ("/home2/alice", "ext4"),  # a prefix of the name is not a prefix of the path
    ("/scratch/alice/run1", "lustre"),
    ("/gpfs/projects/x", "gpfs"),
    ("/gpfs", "ext4"),
    ("/tmp", "tmpfs"),
    ("/home/alice/remote/db", "fuse.sshfs"),  # the longest mount point wins
    ("/mnt/team share/ops", "cifs"),  # \040 in mountinfo is a space
    ("/mnt/cache", "tmpfs"),  # the later of two mounts on one directory hides the earlier
    ("/ceph/x", "ceph"),
    ("/var/lib", "ext4"),
])
def test_mount_fstype_picks_the_longest_mount_point(directory: str, fstype: str) -> None:
    assert mount_fstype(MOUNTINFO, directory) == fstype


@pytest.mark.parametrize("fstype, network", [
    ("nfs4", True), ("nfs", True), ("lustre", True), ("gpfs", True), ("cifs", True), ("smb3", True),
    ("ceph", True), ("9p", True), ("fuse.sshfs", True), ("fuse.ceph-fuse", True), ("fuse.glusterfs", True),
    ("ext4", False), ("xfs", False), ("tmpfs", False), ("overlay", False), ("btrfs", False),
    ("fuse.lxcfs", False), ("fuse", False), (None, False), ("", False),
])
def test_network_filesystems(fstype: str | None, network: bool) -> None:
    assert is_network_fstype(fstype) is network


def test_garbage_mountinfo_gives_none() -> None:
    assert mount_fstype("", "/home") is None
    assert mount_fstype("not a mountinfo line\n1 2 3\n", "/home") is None


def test_this_machines_temp_dir_is_local_and_sqlite_works_there(tmp_path: Path) -> None:
    """The real check: the mount table of this machine says tmp_path is on a local filesystem."""
    fstype = fstype_of(str(tmp_path / "e.db"))
    assert fstype and not is_network_fstype(fstype), fstype
    Store(f"sqlite:///{tmp_path / 'e.db'}").close()
    assert (tmp_path / "e.db").exists()


@pytest.fixture
def nfs_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A mount table in which tmp_path is an NFS mount (as $HOME is on a cluster)."""
    table = tmp_path.parent / f"{tmp_path.name}-mountinfo"
    table.write_text(MOUNTINFO + f"50 22 0:60 / {os.path.realpath(tmp_path)} rw - nfs4 fs1:/home rw\n")
    monkeypatch.setattr("db.fs.MOUNTINFO", str(table))
    return tmp_path


@pytest.mark.parametrize("kwargs", [{}, {"create": False}, {"readonly": True}])
def test_sqlite_on_nfs_is_refused_before_anything_is_written(nfs_here: Path, kwargs: dict[str, bool]) -> None:
    target = nfs_here / "e.db"
    if kwargs:  # opening an existing file is refused too, and it is left as it was
        target.write_bytes(b"")
    with pytest.raises(DatabaseError) as err:
        Store(f"sqlite:///{target}", **kwargs)
    message = str(err.value)
    assert "\n" not in message and "nfs4, a network filesystem" in message and "WAL" in message
    assert "postgresql+psycopg://" in message and "$TMPDIR" in message
    assert sorted(p.name for p in nfs_here.iterdir()) == (["e.db"] if kwargs else [])
    if kwargs:
        assert target.read_bytes() == b""


def test_elastic_launch_and_dashboard_refuse_it_in_one_line(nfs_here: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Both commands exit 2 with the one-line reason and create nothing."""
    from launcher.launch import main as launch_main

    monkeypatch.setenv("ELASTIC_SECRET_KEY", "0123456789abcdef0123456789abcdef")

    url = f"sqlite:///{nfs_here / 'e.db'}"
    assert launch_main(["--backend", "local", "--nnodes", "1", "--gpus-per-node", "1", "--db", url,
                        "--", "python", "-c", "pass"]) == 2
    assert main(["dashboard", "--db", url, "--port", "1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "network filesystem" in line]
    assert len(lines) == 2, err
    assert list(nfs_here.iterdir()) == []
