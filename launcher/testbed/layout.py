"""The testbed's files on disk: folders, fake GPU devices and the configuration files of launcher.testbed.config.

Kept apart from the daemons so `up()` can tell whether the running daemons read this shape's
configuration (the files on disk match) before it decides what to restart.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from launcher.testbed.config import (
    HOST_RELEASE,
    cgroup_conf_text,
    gres_conf_text,
    node_names,
    slurm_conf_text,
    slurmdbd_conf_text,
)


def slurm_conf_path(root: Path) -> Path:
    return root / "etc" / "slurm.conf"


def gres_conf_path(root: Path) -> Path:
    return root / "etc" / "gres.conf"


def shape_path(root: Path) -> Path:
    """The shape last written, `4,4,2,2`: how `status` and `down` learn which shape is running."""
    return root / "etc" / "shape"


def config_matches(root: Path, gpus: tuple[int, ...], release: str = HOST_RELEASE, rpc_limit: str = "") -> bool:
    """The files on disk are the ones this shape writes (so the running daemons read them)."""
    try:
        return (slurm_conf_path(root).read_text() == slurm_conf_text(root, gpus, release, rpc_limit)
                and gres_conf_path(root).read_text() == gres_conf_text(root, gpus))
    except OSError:
        return False


def write_layout(root: Path, gpus: tuple[int, ...], release: str = HOST_RELEASE, rpc_limit: str = "") -> None:
    """Create folders, fake GPU devices and config files (rewritten on every up)."""
    for sub in ("etc", "log", "run", "state/ctld", "munge", "mysql", "dev"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    for node, count in zip(node_names(gpus), gpus):
        (root / "state" / f"slurmd-{node}").mkdir(parents=True, exist_ok=True)
        make_fake_gpus(root / "dev" / node, count)
    slurm_conf_path(root).write_text(slurm_conf_text(root, gpus, release, rpc_limit))
    cgroup = root / "etc" / "cgroup.conf"
    cgroup_text = cgroup_conf_text(release)
    if cgroup_text is None:
        cgroup.unlink(missing_ok=True)
    else:
        cgroup.write_text(cgroup_text)
    gres_conf_path(root).write_text(gres_conf_text(root, gpus))
    shape_path(root).write_text(",".join(map(str, gpus)) + "\n")
    dbd = root / "etc" / "slurmdbd.conf"
    dbd.write_text(slurmdbd_conf_text(root, release))
    os.chmod(dbd, 0o600)  # slurmdbd refuses a config others can read


def make_fake_gpus(folder: Path, count: int) -> None:
    """GRES File= must be character devices; /dev/null's numbers (1,3) are harmless."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        path = folder / f"nvidia{i}"
        if path.exists() and stat.S_ISCHR(path.stat().st_mode):
            continue
        if path.exists() or path.is_symlink():
            path.unlink()
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
