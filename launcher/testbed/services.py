"""The services under Slurm that the testbed shares between shapes: the Slurm packages themselves,
munge (authentication) and MariaDB (accounting, behind slurmdbd).

They stay up when the shape changes; only slurmctld and the slurmd restart (launcher.testbed.cluster).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from launcher.testbed.config import INSTALL_SCRIPT, MUNGE_SOCKET, MYSQL_SOCKET, MYSQL_SOCKET_DIR
from launcher.testbed.daemons import Daemon, DaemonProcesses, is_socket
from launcher.testbed.errors import TestbedError

REQUIRED_BINARIES = (
    "slurmctld", "slurmd", "slurmdbd", "sinfo", "scontrol", "munged", "mungekey", "munge", "unmunge",
    "mariadbd", "mariadb-install-db",
)

Log = Callable[[str], None]


def ensure_installed(log: Log) -> None:
    missing = [b for b in REQUIRED_BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if not missing:
        return
    log(f"installing Slurm packages (missing: {', '.join(missing)}) ...")
    result = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True)
    if result.returncode != 0:
        raise TestbedError(
            f"{INSTALL_SCRIPT} failed (exit {result.returncode}): "
            f"{(result.stderr or result.stdout).strip()[-2000:]}\n"
            "check network access to the Debian mirrors and rerun"
        )


def start_munge(processes: DaemonProcesses, munged: Daemon, root: Path, log: Log) -> None:
    """Start our munged on the standard socket, or reuse a live one already there.

    Any munged works: every daemon and client of the testbed talks to the
    same socket, so they all share whichever key that munged holds.
    """
    if munge_works():
        log(f"reusing the munged already listening on {MUNGE_SOCKET}")
        return
    key = root / "munge" / "munge.key"
    if not key.exists():
        log("creating munge key")
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
    os.chmod(key, 0o600)
    MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
    for stale in (MUNGE_SOCKET, Path(f"{MUNGE_SOCKET}.lock")):
        stale.unlink(missing_ok=True)  # left by a munged that died
    log("starting munged")
    processes.spawn(munged)
    processes.wait("waiting for munged's socket", munge_works, munged)


def munge_works() -> bool:
    """True when a credential encoded through the socket decodes again."""
    if not is_socket(MUNGE_SOCKET):
        return False
    try:
        enc = subprocess.run(["munge", "-n", "-S", str(MUNGE_SOCKET)],
                             capture_output=True, timeout=5)
        if enc.returncode != 0:
            return False
        dec = subprocess.run(["unmunge", "-S", str(MUNGE_SOCKET)], input=enc.stdout,
                             capture_output=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return dec.returncode == 0


def start_mariadb(processes: DaemonProcesses, mariadb: Daemon, root: Path, log: Log) -> None:
    datadir = root / "mysql"
    if not (datadir / "mysql").is_dir():
        log("initialising MariaDB data folder (first run only)")
        result = subprocess.run(
            ["mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={datadir}",
             "--auth-root-authentication-method=socket", "--skip-test-db"],
            capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise TestbedError(f"mariadb-install-db failed: {result.stdout[-1500:]}{result.stderr[-1500:]}")
    MYSQL_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
    if MYSQL_SOCKET.exists():
        MYSQL_SOCKET.unlink()  # stale: our mariadbd is not running (down() ran first)
    log("starting MariaDB")
    processes.spawn(mariadb)
    processes.wait("waiting for MariaDB's socket", lambda: is_socket(MYSQL_SOCKET), mariadb)
