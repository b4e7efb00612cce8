"""Which filesystem a database file lives on, so SQLite is refused where it corrupts data.

SQLite's WAL mode needs shared memory between every process that opens the file, and its locks
rely on POSIX byte-range locks: neither holds on a network filesystem (SQLite's own docs, "WAL
does not work over a network filesystem"). On a cluster $HOME is NFS, Lustre or GPFS and the
launchers and the dashboard run on different hosts, so a SQLite file there loses or corrupts
history silently. Detection reads /proc/self/mountinfo (the longest mount point that is a
prefix of the file's directory); `mount_fstype` is pure so it is tested on fixture text.
"""
from __future__ import annotations

import os
import re

#: Filesystem types (the mountinfo field after " - ") shared between hosts over a network or a
#: shared disk; "fuse.X" types are matched on X (sshfs, a FUSE client of a network filesystem).
NETWORK_FSTYPES = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "9p", "afs", "glusterfs",
    "beegfs", "pvfs2", "orangefs", "ocfs2", "gfs2", "panfs", "wekafs", "davfs", "ncpfs", "coda",
})
NETWORK_FUSE = frozenset({
    "sshfs", "glusterfs", "ceph", "ceph-fuse", "cephfs", "s3fs", "gcsfuse", "juicefs", "rclone",
    "beegfs", "davfs2", "lustre", "goofys", "blobfuse", "blobfuse2", "moosefs", "mfs", "lizardfs",
})

MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    r"""mountinfo writes space, tab, newline and backslash in paths as octal (\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_fstype(mountinfo: str, path: str) -> str | None:
    """The filesystem type of the mount holding absolute `path` (already resolved), from the
    text of /proc/self/mountinfo; None when no line parses. The last of equal mount points wins
    (a later mount hides an earlier one on the same directory)."""
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if sep + 1 >= len(fields):
            continue
        point, fstype = _unescape(fields[4]), fields[sep + 1]
        inside = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fstype)
    return best[1] if best else None


def is_network_fstype(fstype: str | None) -> bool:
    """True for filesystems shared between hosts (NFS, Lustre, GPFS, CIFS/SMB, Ceph, 9p, FUSE
    clients of those ...)."""
    if not fstype:
        return False
    if fstype.startswith("fuse."):
        return fstype[5:] in NETWORK_FUSE
    return fstype in NETWORK_FSTYPES


def fstype_of(path: str, mountinfo_path: str | None = None) -> str | None:
    """The filesystem type of the directory that holds (or will hold) file `path`; None where
    the mount table cannot be read (not Linux): then nothing is refused."""
    directory = os.path.dirname(os.path.realpath(path))
    try:
        with open(mountinfo_path or MOUNTINFO, encoding="utf-8", errors="surrogateescape") as fh:
            text = fh.read()
    except OSError:
        return None
    return mount_fstype(text, directory)
