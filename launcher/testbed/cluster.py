"""A real Slurm 22.05 cluster on loopback (4 nodes x 4 GPUs by default), for tests and demos.

Why a real cluster and not a mock: the launcher's hard parts (shrinking a
running job, steps that overlap, GRES, accounting) live in slurmctld's
behaviour, which no fake reproduces. Debian's Slurm build supports several
slurmd on one host (MULTIPLE_SLURMD), so four `slurmd -N nX` processes on
127.0.0.1 with distinct ports make a 4-node cluster in about a second.

Everything (configs, state, logs, MariaDB data, munge key and socket) lives
under one root folder, so the testbed never touches /etc/slurm or the system
munge/MariaDB and can be wiped with `rm -rf`. Only MariaDB's socket sits under
/run/mysqld, where libmariadb looks for it when slurmdbd connects to
`localhost`.

Accounting (slurmdbd + MariaDB) is on because without it Slurm 22.05 lets a
running job be resized only once ("the DB index is being set").

The shape is a tuple of GPUs per node: the default (4, 4, 4, 4) is what every
Slurm test expects. An uneven shape (`elastic testbed up --gpus 4,4,2,2`) is
opt-in: it adds one partition per GPU count (`gpu4`, `gpu2`) next to `debug`
(all nodes), so a heterogeneous job can take its components from two
partitions. `up()` compares the configuration on disk with the one it would
write and restarts the Slurm daemons when they differ, so a test that needs a
shape asks for it and a test of the default shape gets the default back.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path("/tmp/elastic-testbed")
NODES = ("n1", "n2", "n3", "n4")
GPUS_PER_NODE = 4
DEFAULT_GPUS = (GPUS_PER_NODE,) * len(NODES)
MAX_GPUS_PER_NODE = 8  # fake devices and CPUs per node; also bounds --gpus
MAX_NODES = 16  # one slurmd process per node, on one small machine
CPUS_PER_NODE = 4
CLUSTER_NAME = "elastic"
PARTITION = "debug"

# Non-default ports so a system Slurm (6817/6818/6819) can coexist.
CTLD_PORT = 26817
DBD_PORT = 26819
SLURMD_BASE_PORT = 26901  # n1 -> 26901, n2 -> 26902, ...

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
MYSQL_SOCKET_DIR = Path("/run/mysqld")
MYSQL_SOCKET = MYSQL_SOCKET_DIR / "elastic-testbed.sock"
DB_NAME = "slurm_acct_db_elastic"

INSTALL_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-slurm.sh"
REQUIRED_BINARIES = (
    "slurmctld", "slurmd", "slurmdbd", "sinfo", "scontrol", "munged", "mungekey", "munge", "unmunge",
    "mariadbd", "mariadb-install-db",
)

UP_TIMEOUT_S = 60.0
STOP_GRACE_S = 3.0


def _real_exe(name: str) -> str:
    """Where /proc/PID/exe of a process started as `name` points (Debian installs
    slurmctld as an alternatives link to slurmctld-wlm, so resolve links)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    return os.path.realpath(found) if found else name


def _inherited_fds() -> list[int]:
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


class TestbedError(RuntimeError):
    """The testbed could not be brought up or down; the message says where to look."""

    __test__ = False  # not a pytest test class despite the name


@dataclass(frozen=True)
class _Daemon:
    """One process the testbed owns: its name (also the pid file stem) and command."""

    name: str
    argv: list[str]
    exe: str  # program name; /proc/PID/exe is checked against it so a reused pid is never signalled


def parse_gpus(text: str) -> tuple[int, ...]:
    """`4,4,2,2` -> (4, 4, 2, 2): GPUs of each node, n1 first. One-line ValueError on bad input."""
    try:
        gpus = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--gpus wants GPU counts per node separated by commas (e.g. 4,4,2,2), got {text!r}") from None
    if not 1 <= len(gpus) <= MAX_NODES or not all(1 <= g <= MAX_GPUS_PER_NODE for g in gpus):
        raise ValueError(f"--gpus {text}: need 1..{MAX_NODES} nodes of 1..{MAX_GPUS_PER_NODE} GPUs each")
    return gpus


def uneven_partitions(gpus: tuple[int, ...]) -> dict[str, list[str]]:
    """Extra partitions of an uneven shape: `gpuG` -> the nodes with G GPUs (none when all alike,
    so the default shape's configuration stays exactly as it was)."""
    if len(set(gpus)) < 2:
        return {}
    parts: dict[str, list[str]] = {}
    for i, g in sorted(enumerate(gpus), key=lambda item: (-item[1], item[0])):
        parts.setdefault(f"gpu{g}", []).append(f"n{i + 1}")
    return parts


class Testbed:
    """A Slurm cluster on loopback (by default 4 nodes x 4 GPUs) whose whole state lives under `root`.

    `up()` is idempotent and returns the SLURM_CONF path; `down()` stops every
    daemon it started and is safe to call twice. The daemons outlive the Python
    process that started them (own session), so `elastic testbed up` can exit
    and leave the cluster running.
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, root: Path | str = DEFAULT_ROOT, *, verbose: bool = True,
                 gpus: tuple[int, ...] = DEFAULT_GPUS) -> None:
        self.root = Path(root).resolve()
        self.verbose = verbose
        self.gpus = tuple(gpus)
        self.nodes = tuple(f"n{i + 1}" for i in range(len(self.gpus)))

    @classmethod
    def as_running(cls, root: Path | str = DEFAULT_ROOT, *, verbose: bool = True) -> "Testbed":
        """The testbed with the shape its configuration on disk has (the default when there is none),
        for `status`/`down`, which must not change the shape."""
        try:
            shaped = cls(root, verbose=verbose, gpus=parse_gpus((Path(root) / "etc" / "shape").read_text().strip()))
        except (OSError, ValueError):
            shaped = None
        return shaped if shaped is not None and shaped._config_matches() else cls(root, verbose=verbose)

    # ----------------------------------------------------------------- paths
    @property
    def slurm_conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def munge_socket(self) -> Path:
        """munged's socket: the standard path, because slurmctld ignores AuthInfo=socket=
        when it authenticates to slurmdbd (it always dials /run/munge/munge.socket.2)."""
        return MUNGE_SOCKET

    def env(self) -> dict[str, str]:
        """Environment for Slurm clients talking to this cluster (merge into os.environ)."""
        return {
            "SLURM_CONF": str(self.slurm_conf),
            # libmariadb honours this; slurmdbd needs it to find our MariaDB.
            "MYSQL_UNIX_PORT": str(MYSQL_SOCKET),
        }

    def _full_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env())
        return env

    def _log(self, msg: str) -> None:
        if self.verbose:
            print(f"[testbed] {msg}", file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- status
    def is_up(self) -> bool:
        """True when every daemon is alive, the configuration on disk is this shape's and sinfo
        shows all its nodes usable."""
        if not self._config_matches():
            return False
        ours = [d for d in self._daemons() if d.name != "munged"]  # munged may be reused
        if any(self._pid_of(d.name, d.exe) is None for d in ours) or not self._munge_works():
            return False
        states = self.node_states()
        return len(states) == len(self.nodes) and all(
            s.rstrip("*~#!%$@^-") in ("idle", "mixed", "allocated", "completing")
            for s in states.values()
        )

    def daemon_pids(self) -> dict[str, int | None]:
        """Each daemon's pid, or None when it is not running (for `status`)."""
        return {d.name: self._pid_of(d.name, d.exe) for d in self._daemons()}

    def node_states(self) -> dict[str, str]:
        """Node name -> sinfo state ('idle', 'down*', ...); empty if sinfo fails."""
        try:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                env=self._full_env(), capture_output=True, text=True, timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if out.returncode != 0:
            return {}
        states: dict[str, str] = {}
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    # -------------------------------------------------------------------- up
    def up(self, timeout: float = UP_TIMEOUT_S) -> Path:
        """Bring the cluster up (or confirm it is) and return the SLURM_CONF path."""
        self._require_root()
        if self.is_up():
            self._log(f"already up: {self.slurm_conf}")
            return self.slurm_conf
        t0 = time.monotonic()
        if self._base_running() and not self._config_matches():
            # Another shape is up: only slurmctld (-c: no jobs kept) and the slurmd change.
            self._log(f"reshaping to {len(self.nodes)} nodes with GPUs {','.join(map(str, self.gpus))}")
            self._stop_slurm()
            self._write_layout()
        else:
            # Half-up (a daemon died, or left over from a crash): restart cleanly.
            self.down(quiet=True)
            self._ensure_installed()
            self._write_layout()
            self._start_munge()
            self._start_mariadb()
            self._start_slurmdbd()
        self._start_slurmctld()
        self._start_slurmds()
        self._wait_nodes_idle(deadline=time.monotonic() + timeout)
        self._log(f"up in {time.monotonic() - t0:.1f} s: export SLURM_CONF={self.slurm_conf}")
        return self.slurm_conf

    def _config_matches(self) -> bool:
        """The files on disk are the ones this shape writes (so the running daemons read them)."""
        try:
            return (self.slurm_conf.read_text() == self._slurm_conf_text()
                    and (self.root / "etc" / "gres.conf").read_text() == self._gres_conf_text())
        except OSError:
            return False

    def _base_running(self) -> bool:
        """MariaDB and slurmdbd (shape-independent) are alive and munge answers."""
        return all(self._pid_of(d.name, d.exe) is not None for d in self._daemons()
                   if d.name in ("mariadb", "slurmdbd")) and self._munge_works()

    @staticmethod
    def _require_root() -> None:
        if os.geteuid() != 0:
            raise TestbedError(
                "the Slurm testbed must run as root (it starts slurmd, munged and MariaDB); "
                "rerun with sudo or as root"
            )

    def _ensure_installed(self) -> None:
        missing = [b for b in REQUIRED_BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
        if not missing:
            return
        self._log(f"installing Slurm packages (missing: {', '.join(missing)}) ...")
        result = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True)
        if result.returncode != 0:
            raise TestbedError(
                f"{INSTALL_SCRIPT} failed (exit {result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-2000:]}\n"
                "check network access to the Debian mirrors and rerun"
            )

    # ---------------------------------------------------------------- layout
    def _write_layout(self) -> None:
        """Create folders, fake GPU devices and config files (rewritten on every up)."""
        for sub in ("etc", "log", "run", "state/ctld", "munge", "mysql", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        for node, gpus in zip(self.nodes, self.gpus):
            (self.root / "state" / f"slurmd-{node}").mkdir(parents=True, exist_ok=True)
            self._make_fake_gpus(self.root / "dev" / node, gpus)
        self.slurm_conf.write_text(self._slurm_conf_text())
        (self.root / "etc" / "gres.conf").write_text(self._gres_conf_text())
        (self.root / "etc" / "shape").write_text(",".join(map(str, self.gpus)) + "\n")
        dbd = self.root / "etc" / "slurmdbd.conf"
        dbd.write_text(self._slurmdbd_conf_text())
        os.chmod(dbd, 0o600)  # slurmdbd refuses a config others can read

    @staticmethod
    def _make_fake_gpus(folder: Path, count: int) -> None:
        """GRES File= must be character devices; /dev/null's numbers (1,3) are harmless."""
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            path = folder / f"nvidia{i}"
            if path.exists() and stat.S_ISCHR(path.stat().st_mode):
                continue
            if path.exists() or path.is_symlink():
                path.unlink()
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))

    def _slurm_conf_text(self) -> str:
        r = self.root
        last_port = SLURMD_BASE_PORT + len(self.nodes) - 1
        nodes = f"n[1-{len(self.nodes)}]"
        return f"""\
# Written by launcher/testbed.py; rewritten on every `up`.
ClusterName={CLUSTER_NAME}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_BASE_PORT}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state/ctld
SlurmdSpoolDir={r}/state/slurmd-%n
SlurmctldPidFile={r}/run/slurmctld.slurm.pid
SlurmdPidFile={r}/run/slurmd-%n.slurm.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=permit_job_expansion,bf_interval=1
MpiDefault=none
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={DBD_PORT}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
MessageTimeout=10
{self._node_lines(last_port)}
PartitionName={PARTITION} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP
""" + "".join(f"PartitionName={name} Nodes={','.join(members)} MaxTime=INFINITE State=UP\n"
              for name, members in uneven_partitions(self.gpus).items())

    def _node_lines(self, last_port: int) -> str:
        """One NodeName line for all nodes when they are alike (the default's exact text), else one
        per node with its own port, GPUs and CPUs (a node gets max(4, GPUs) CPUs: a task per GPU)."""
        if len(set(self.gpus)) == 1:
            groups = [(f"n[1-{len(self.nodes)}]", f"{SLURMD_BASE_PORT}-{last_port}", self.gpus[0])]
        else:
            groups = [(n, str(SLURMD_BASE_PORT + i), g) for i, (n, g) in enumerate(zip(self.nodes, self.gpus))]
        return "\n".join(
            f"NodeName={names} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports} "
            f"CPUs={max(CPUS_PER_NODE, g)} Sockets=1 CoresPerSocket={max(CPUS_PER_NODE, g)} ThreadsPerCore=1 "
            f"RealMemory=1024 Gres=gpu:{g} State=UNKNOWN"
            for names, ports, g in groups
        )

    def _gres_conf_text(self) -> str:
        lines = ["# Fake GPUs: character devices made with mknod (c 1 3)."]
        for node, gpus in zip(self.nodes, self.gpus):
            files = "nvidia0" if gpus == 1 else f"nvidia[0-{gpus - 1}]"
            lines.append(f"NodeName={node} Name=gpu File={self.root}/dev/{node}/{files}")
        return "\n".join(lines) + "\n"

    def _slurmdbd_conf_text(self) -> str:
        r = self.root
        return f"""\
# Written by launcher/testbed.py; slurmdbd reads it from SLURM_CONF's folder.
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={DBD_PORT}
SlurmUser=root
DebugLevel=info
LogFile={r}/log/slurmdbd.log
PidFile={r}/run/slurmdbd.slurm.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc={DB_NAME}
"""

    # -------------------------------------------------------------- daemons
    def _daemons(self) -> list[_Daemon]:
        """Every daemon in start order; down() stops them in reverse (slurmd first)."""
        r = self.root
        conf = str(self.slurm_conf)
        daemons = [
            _Daemon("munged", [
                "munged", "-F", "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={r}/munge/munge.key",
                f"--pid-file={r}/run/munged.munge.pid",
                f"--seed-file={r}/munge/munged.seed",
                f"--log-file={r}/log/munged.log",
            ], "munged"),
            _Daemon("mariadb", [
                "mariadbd", "--no-defaults", "--user=root",
                f"--datadir={r}/mysql", f"--socket={MYSQL_SOCKET}", "--skip-networking",
                f"--pid-file={r}/run/mariadb.mysql.pid", f"--log-error={r}/log/mariadb.log",
                "--innodb-buffer-pool-size=64M", "--skip-log-bin",
            ], "mariadbd"),
            _Daemon("slurmdbd", ["slurmdbd", "-D"], "slurmdbd"),
            # -c: forget jobs from a previous session so every `up` starts clean.
            _Daemon("slurmctld", ["slurmctld", "-D", "-c", "-f", conf], "slurmctld"),
        ]
        for node in self._slurmd_nodes():
            daemons.append(_Daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", conf], "slurmd"))
        return daemons

    def _slurmd_nodes(self) -> list[str]:
        """This shape's nodes, then any other node whose slurmd pid file is left from another shape
        (so down() and a reshape stop it too)."""
        left = sorted((p.name[len("slurmd-"):-len(".pid")] for p in self.run_dir.glob("slurmd-n*.pid")
                       if not p.name.endswith(".slurm.pid")), key=lambda n: int(n[1:]) if n[1:].isdigit() else 0)
        return list(self.nodes) + [n for n in left if n not in self.nodes]

    def _daemon(self, name: str) -> _Daemon:
        return next(d for d in self._daemons() if d.name == name)

    def _pid_file(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def _spawn(self, daemon: _Daemon) -> int:
        """Start one daemon in its own session, output to log/<name>.out, pid recorded.

        posix_spawn, not Popen: the daemons are meant to outlive this process,
        and a Popen object dropped while its child runs warns (ResourceWarning).
        """
        out = os.open(self.log_dir / f"{daemon.name}.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            pid = os.posix_spawnp(
                daemon.argv[0], daemon.argv, self._full_env(), setsid=True,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, out, 1),
                    (os.POSIX_SPAWN_DUP2, out, 2),
                    *[(os.POSIX_SPAWN_CLOSE, fd) for fd in _inherited_fds() if fd != out],
                ],
            )
        except OSError as exc:
            raise TestbedError(f"could not start {daemon.name} ({' '.join(daemon.argv)}): {exc}; "
                               f"is it installed? run {INSTALL_SCRIPT}") from exc
        finally:
            os.close(out)
        self._pid_file(daemon.name).write_text(f"{pid}\n")
        return pid

    def _pid_of(self, name: str, exe: str) -> int | None:
        """Pid of a live daemon we started, or None (dead, zombie or pid reused)."""
        try:
            pid = int(self._pid_file(name).read_text().strip())
            # exe, not comm: mariadbd renames its main thread while starting up.
            if os.readlink(f"/proc/{pid}/exe") != _real_exe(exe):
                return None
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            return None
        return None if fields[0] in ("Z", "X") else pid

    def _check_alive(self, daemon: _Daemon, what: str) -> None:
        if self._pid_of(daemon.name, daemon.exe) is None:
            raise TestbedError(
                f"{daemon.name} exited while {what}; last lines of its logs:\n"
                f"{self._tail_logs(daemon.name)}\n{self._log_hint()}"
            )

    def _tail_logs(self, name: str, lines: int = 12) -> str:
        """The end of log/<name>.out (stdout) and log/<name>.log (the daemon's own log)."""
        parts = []
        for path in (self.log_dir / f"{name}.out", self.log_dir / f"{name}.log"):
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(parts) or f"(no log for {name} in {self.log_dir})"

    def _wait(self, what: str, ready, daemon: _Daemon, timeout: float = 30.0) -> None:
        """Poll `ready()` until true; fail early if the daemon died, late with logs named."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            self._check_alive(daemon, what)
            time.sleep(0.1)
        raise TestbedError(f"timed out after {timeout:.0f} s {what}; {self._log_hint()}")

    def _log_hint(self) -> str:
        logs = sorted(str(p) for p in self.log_dir.glob("*")) if self.log_dir.exists() else []
        return "look at: " + ", ".join(logs) if logs else f"no logs in {self.log_dir}"

    def _start_munge(self) -> None:
        """Start our munged on the standard socket, or reuse a live one already there.

        Any munged works: every daemon and client of the testbed talks to the
        same socket, so they all share whichever key that munged holds.
        """
        if self._munge_works():
            self._log(f"reusing the munged already listening on {self.munge_socket}")
            return
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            self._log("creating munge key")
            subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self.munge_socket.parent.mkdir(parents=True, exist_ok=True)
        for stale in (self.munge_socket, Path(f"{self.munge_socket}.lock")):
            stale.unlink(missing_ok=True)  # left by a munged that died
        self._log("starting munged")
        d = self._daemon("munged")
        self._spawn(d)
        self._wait("waiting for munged's socket", self._munge_works, d)

    def _munge_works(self) -> bool:
        """True when a credential encoded through the socket decodes again."""
        if not self._is_socket(self.munge_socket):
            return False
        try:
            enc = subprocess.run(["munge", "-n", "-S", str(self.munge_socket)],
                                 capture_output=True, timeout=5)
            if enc.returncode != 0:
                return False
            dec = subprocess.run(["unmunge", "-S", str(self.munge_socket)], input=enc.stdout,
                                 capture_output=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return dec.returncode == 0

    def _start_mariadb(self) -> None:
        datadir = self.root / "mysql"
        if not (datadir / "mysql").is_dir():
            self._log("initialising MariaDB data folder (first run only)")
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
        self._log("starting MariaDB")
        d = self._daemon("mariadb")
        self._spawn(d)
        self._wait("waiting for MariaDB's socket", lambda: self._is_socket(MYSQL_SOCKET), d)

    def _start_slurmdbd(self) -> None:
        self._log("starting slurmdbd")
        d = self._daemon("slurmdbd")
        self._spawn(d)
        self._wait(f"waiting for slurmdbd on port {DBD_PORT}", lambda: self._port_open(DBD_PORT), d)

    def _start_slurmctld(self) -> None:
        self._log("starting slurmctld")
        d = self._daemon("slurmctld")
        self._spawn(d)
        self._wait("waiting for slurmctld to answer `scontrol ping`", self._ctld_answers, d)

    def stop_slurmctld(self) -> None:
        """Stop the controller only (fault tests): jobs and their steps keep running on the slurmd."""
        self._stop_group([self._daemon("slurmctld")])

    def restart_slurmctld(self) -> None:
        """Start the controller again keeping its saved state (no -c), so running jobs are still known."""
        d = self._daemon("slurmctld")
        d = _Daemon(d.name, [a for a in d.argv if a != "-c"], d.exe)
        self._log("restarting slurmctld (state kept)")
        self._spawn(d)
        self._wait("waiting for the restarted slurmctld to answer `scontrol ping`", self._ctld_answers, d)

    def _start_slurmds(self) -> None:
        self._log(f"starting {len(self.nodes)} slurmd ({', '.join(self.nodes)}; GPUs {','.join(map(str, self.gpus))})")
        for node in self.nodes:
            self._spawn(self._daemon(f"slurmd-{node}"))

    def _wait_nodes_idle(self, deadline: float) -> None:
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for d in self._daemons():
                self._check_alive(d, "waiting for the nodes to become idle")
            states = self.node_states()
            if sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.2)
        raise TestbedError(
            f"timed out waiting for {len(self.nodes)} idle nodes (sinfo says {states or 'nothing'}); "
            + self._log_hint()
        )

    def _ctld_answers(self) -> bool:
        r = subprocess.run(["scontrol", "ping"], env=self._full_env(), capture_output=True, text=True)
        return r.returncode == 0 and "UP" in r.stdout

    @staticmethod
    def _is_socket(path: Path) -> bool:
        try:
            return stat.S_ISSOCK(path.stat().st_mode)
        except OSError:
            return False

    @staticmethod
    def _port_open(port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0

    # ------------------------------------------------------------------ down
    def down(self, quiet: bool = False) -> None:
        """Stop every daemon we started, slurmd first; safe to call when nothing runs.

        A slurmd that keeps retrying a dead controller ignores SIGTERM, so
        every TERM is followed by KILL after a short grace period. The four
        slurmd stop together to keep `down` quick.
        """
        daemons = self._daemons()
        groups = [[d for d in daemons if d.name.startswith("slurmd-")]]
        groups += [[d] for d in reversed(daemons) if not d.name.startswith("slurmd-")]
        stopped = self._stop_groups(groups)
        if not quiet:
            self._log("stopped " + (", ".join(stopped) if stopped else "nothing (was not running)"))

    def _stop_slurm(self) -> None:
        """Stop the slurmd (every shape's) and then slurmctld; munged, MariaDB and slurmdbd stay."""
        daemons = self._daemons()
        self._stop_groups([[d for d in daemons if d.name.startswith("slurmd-")], [self._daemon("slurmctld")]])

    def _stop_groups(self, groups: list[list[_Daemon]]) -> list[str]:
        stopped: list[str] = []
        for group in groups:
            stopped += self._stop_group(group)
        return stopped

    def _stop_group(self, group: list[_Daemon]) -> list[str]:
        """TERM every live daemon in the group, wait, then KILL the ones still there."""
        live = {d.name: (d, pid) for d in group if (pid := self._pid_of(d.name, d.exe)) is not None}
        for d in group:
            if d.name not in live:
                self._pid_file(d.name).unlink(missing_ok=True)
        for _, pid in live.values():
            self._signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(
            self._pid_of(d.name, d.exe) == pid for d, pid in live.values()
        ):
            time.sleep(0.05)
        for d, pid in live.values():
            if self._pid_of(d.name, d.exe) == pid:
                self._signal(pid, signal.SIGKILL)
            self._reap(pid)
            self._pid_file(d.name).unlink(missing_ok=True)
        return list(live)

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    @staticmethod
    def _reap(pid: int) -> None:
        """Collect the exit status if we are the parent (same Python process as up())."""
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
