"""The testbed's processes: which daemons it runs, and starting, finding and stopping them by pid file.

Every daemon runs in its own session and outlives the Python process that started it, so a daemon
is known only by the pid file under `run/` and by /proc/PID/exe, which guards against a reused pid.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from launcher.testbed.config import INSTALL_SCRIPT, MUNGE_SOCKET, MYSQL_SOCKET
from launcher.testbed.errors import TestbedError
from launcher.testbed.layout import slurm_conf_path

STOP_GRACE_S = 3.0


def real_exe(name: str) -> str:
    """Where /proc/PID/exe of a process started as `name` points (Debian installs
    slurmctld as an alternatives link to slurmctld-wlm, so resolve links)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    return os.path.realpath(found) if found else name


def inherited_fds() -> list[int]:
    """Open descriptors above 2 that a spawned daemon would inherit (posix_spawn keeps them).

    They must be closed in the daemon: `flock /tmp/elastic-slurm.lock elastic testbed up` hands
    the lock's descriptor to this process, and a munged or slurmdbd that kept it would hold the
    team's Slurm lock for as long as the testbed runs.
    """
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and os.get_inheritable(fd):
                fds.append(fd)
        except OSError:  # the descriptor listdir used, closed by now
            continue
    return fds


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass(frozen=True)
class Daemon:
    """One process the testbed owns: its name (also the pid file stem) and command."""

    name: str
    argv: list[str]
    exe: str  # program name; /proc/PID/exe is checked against it so a reused pid is never signalled


def testbed_daemons(root: Path, nodes: Sequence[str], accounting: bool = True) -> list[Daemon]:
    """Every daemon in start order; down() stops them in reverse (slurmd first). Without accounting,
    no MariaDB and no slurmdbd."""
    r = root
    conf = str(slurm_conf_path(root))
    daemons = [
        Daemon("munged", [
            "munged", "-F", "--force",
            f"--socket={MUNGE_SOCKET}",
            f"--key-file={r}/munge/munge.key",
            f"--pid-file={r}/run/munged.munge.pid",
            f"--seed-file={r}/munge/munged.seed",
            f"--log-file={r}/log/munged.log",
        ], "munged"),
        Daemon("mariadb", [
            "mariadbd", "--no-defaults", "--user=root",
            f"--datadir={r}/mysql", f"--socket={MYSQL_SOCKET}", "--skip-networking",
            f"--pid-file={r}/run/mariadb.mysql.pid", f"--log-error={r}/log/mariadb.log",
            "--innodb-buffer-pool-size=64M", "--skip-log-bin",
        ], "mariadbd"),
        Daemon("slurmdbd", ["slurmdbd", "-D"], "slurmdbd"),
    ]
    if not accounting:
        daemons = daemons[:1]
    daemons += [
        # -c: forget jobs from a previous session so every `up` starts clean.
        Daemon("slurmctld", ["slurmctld", "-D", "-c", "-f", conf], "slurmctld"),
    ]
    for node in _slurmd_nodes(root / "run", nodes):
        daemons.append(Daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", conf], "slurmd"))
    return daemons


def _slurmd_nodes(run_dir: Path, nodes: Sequence[str]) -> list[str]:
    """This shape's nodes, then any other node whose slurmd pid file is left from another shape
    (so down() and a reshape stop it too)."""
    left = sorted((p.name[len("slurmd-"):-len(".pid")] for p in run_dir.glob("slurmd-n*.pid")
                   if not p.name.endswith(".slurm.pid")), key=lambda n: int(n[1:]) if n[1:].isdigit() else 0)
    return list(nodes) + [n for n in left if n not in nodes]


class DaemonProcesses:
    """The daemons of one testbed root as processes: spawned with a pid file under `run/` and output
    under `log/`, found again through those pid files, stopped TERM first and KILL after a grace."""

    def __init__(self, root: Path, env: Callable[[], Mapping[str, str]]) -> None:
        self.run_dir = root / "run"
        self.log_dir = root / "log"
        self.env = env

    def pid_file(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def spawn(self, daemon: Daemon) -> int:
        """Start one daemon in its own session, output to log/<name>.out, pid recorded.

        posix_spawn, not Popen: the daemons are meant to outlive this process,
        and a Popen object dropped while its child runs warns (ResourceWarning).
        """
        out = os.open(self.log_dir / f"{daemon.name}.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            pid = os.posix_spawnp(
                daemon.argv[0], daemon.argv, dict(self.env()), setsid=True,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, out, 1),
                    (os.POSIX_SPAWN_DUP2, out, 2),
                    *[(os.POSIX_SPAWN_CLOSE, fd) for fd in inherited_fds() if fd != out],
                ],
            )
        except OSError as exc:
            raise TestbedError(f"could not start {daemon.name} ({' '.join(daemon.argv)}): {exc}; "
                               f"is it installed? run {INSTALL_SCRIPT}") from exc
        finally:
            os.close(out)
        self.pid_file(daemon.name).write_text(f"{pid}\n")
        return pid

    def pid_of(self, daemon: Daemon) -> int | None:
        """Pid of a live daemon we started, or None (dead, zombie or pid reused)."""
        try:
            pid = int(self.pid_file(daemon.name).read_text().strip())
            # exe, not comm: mariadbd renames its main thread while starting up.
            if os.readlink(f"/proc/{pid}/exe") != real_exe(daemon.exe):
                return None
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            return None
        return None if fields[0] in ("Z", "X") else pid

    def check_alive(self, daemon: Daemon, what: str) -> None:
        if self.pid_of(daemon) is None:
            raise TestbedError(
                f"{daemon.name} exited while {what}; last lines of its logs:\n"
                f"{self.tail_logs(daemon.name)}\n{self.log_hint()}"
            )

    def tail_logs(self, name: str, lines: int = 12) -> str:
        """The end of log/<name>.out (stdout) and log/<name>.log (the daemon's own log)."""
        parts = []
        for path in (self.log_dir / f"{name}.out", self.log_dir / f"{name}.log"):
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(parts) or f"(no log for {name} in {self.log_dir})"

    def wait(self, what: str, ready: Callable[[], bool], daemon: Daemon, timeout: float = 30.0) -> None:
        """Poll `ready()` until true; fail early if the daemon died, late with logs named."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            self.check_alive(daemon, what)
            time.sleep(0.1)
        raise TestbedError(f"timed out after {timeout:.0f} s {what}; {self.log_hint()}")

    def log_hint(self) -> str:
        logs = sorted(str(p) for p in self.log_dir.glob("*")) if self.log_dir.exists() else []
        return "look at: " + ", ".join(logs) if logs else f"no logs in {self.log_dir}"

    def stop_groups(self, groups: list[list[Daemon]]) -> list[str]:
        stopped: list[str] = []
        for group in groups:
            stopped += self.stop_group(group)
        return stopped

    def stop_group(self, group: list[Daemon]) -> list[str]:
        """TERM every live daemon in the group, wait, then KILL the ones still there."""
        live = {d.name: (d, pid) for d in group if (pid := self.pid_of(d)) is not None}
        for d in group:
            if d.name not in live:
                self.pid_file(d.name).unlink(missing_ok=True)
        for _, pid in live.values():
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(self.pid_of(d) == pid for d, pid in live.values()):
            time.sleep(0.05)
        for d, pid in live.values():
            if self.pid_of(d) == pid:
                _signal(pid, signal.SIGKILL)
            _reap(pid)
            self.pid_file(d.name).unlink(missing_ok=True)
        return list(live)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap(pid: int) -> None:
    """Collect the exit status if we are the parent (same Python process as up())."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
