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
import subprocess
import sys
import time
from pathlib import Path

from launcher.testbed import crash
from launcher.testbed.config import (
    DEFAULT_GPUS,
    DEFAULT_ROOT,
    MUNGE_SOCKET,
    MYSQL_SOCKET,
    gres_conf_text,
    node_names,
    has_accounting,
    parse_gpus,
    ports_for,
    slurm_conf_text,
)
from launcher.testbed.daemons import Daemon, DaemonProcesses, port_open, testbed_daemons
from launcher.testbed.errors import TestbedError
from launcher.testbed.layout import config_matches, shape_path, slurm_conf_path, write_layout
from launcher.testbed.roots import current_release
from launcher.testbed.services import ensure_installed, munge_works, start_mariadb, start_munge

UP_TIMEOUT_S = 60.0


class Testbed:
    """A Slurm cluster on loopback (by default 4 nodes x 4 GPUs) whose whole state lives under `root`.

    `up()` is idempotent and returns the SLURM_CONF path; `down()` stops every
    daemon it started and is safe to call twice. The daemons outlive the Python
    process that started them (own session), so `elastic testbed up` can exit
    and leave the cluster running.
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, root: Path | str = DEFAULT_ROOT, *, verbose: bool = True,
                 gpus: tuple[int, ...] = DEFAULT_GPUS, rpc_limit: str = "") -> None:
        self.root = Path(root).resolve()
        self.verbose = verbose
        self.gpus = tuple(gpus)
        self.rpc_limit = rpc_limit  # Slurm's per-user RPC rate limit (config.slurm_conf_text), "" for none
        self.nodes = node_names(self.gpus)
        # the Slurm release this testbed runs: the host's (Debian 12), or the root's this process runs in
        self.release = current_release()
        self.ports = ports_for(self.release)
        self.processes = DaemonProcesses(self.root, self._full_env)

    @classmethod
    def as_running(cls, root: Path | str = DEFAULT_ROOT, *, verbose: bool = True) -> "Testbed":
        """The testbed with the shape its configuration on disk has (the default when there is none),
        for `status`/`down`, which must not change the shape."""
        try:
            shaped = cls(root, verbose=verbose, gpus=parse_gpus(shape_path(Path(root)).read_text().strip()))
        except (OSError, ValueError):
            shaped = None
        return shaped if shaped is not None and shaped._config_matches() else cls(root, verbose=verbose)

    @classmethod
    def brought_up(cls, who: str) -> "Testbed":
        """The running testbed, in its shape; brought up first when it is down (a bench's start), saying so."""
        testbed = cls.as_running()
        if not testbed.is_up():
            print(f"{who}: bringing the Slurm testbed up (elastic testbed up)", file=sys.stderr, flush=True)
            testbed.up()
        return testbed

    # ----------------------------------------------------------------- paths
    @property
    def slurm_conf(self) -> Path:
        return slurm_conf_path(self.root)

    @property
    def log_dir(self) -> Path:
        return self.processes.log_dir

    @property
    def run_dir(self) -> Path:
        return self.processes.run_dir

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
        if any(self.processes.pid_of(d) is None for d in ours) or not munge_works():
            return False
        states = self.node_states()
        return len(states) == len(self.nodes) and all(
            s.rstrip("*~#!%$@^-") in ("idle", "mixed", "allocated", "completing")
            for s in states.values()
        )

    def daemon_pids(self) -> dict[str, int | None]:
        """Each daemon's pid, or None when it is not running (for `status`)."""
        return {d.name: self.processes.pid_of(d) for d in self._daemons()}

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
            write_layout(self.root, self.gpus, self.release, self.rpc_limit)
        else:
            # Half-up (a daemon died, or left over from a crash): restart cleanly.
            self.down(quiet=True)
            ensure_installed(self._log)
            write_layout(self.root, self.gpus, self.release, self.rpc_limit)
            start_munge(self.processes, self._daemon("munged"), self.root, self._log)
            if has_accounting(self.release):
                start_mariadb(self.processes, self._daemon("mariadb"), self.root, self._log)
                self._start_slurmdbd()
        self._start_slurmctld()
        self._start_slurmds()
        self._wait_nodes_idle(deadline=time.monotonic() + timeout)
        self._log(f"up in {time.monotonic() - t0:.1f} s: export SLURM_CONF={self.slurm_conf}")
        return self.slurm_conf

    def _config_matches(self) -> bool:
        return config_matches(self.root, self.gpus, self.release, self.rpc_limit)

    def _slurm_conf_text(self) -> str:
        return slurm_conf_text(self.root, self.gpus, self.release, self.rpc_limit)

    def _gres_conf_text(self) -> str:
        return gres_conf_text(self.root, self.gpus)

    def _base_running(self) -> bool:
        """MariaDB and slurmdbd (shape-independent) are alive and munge answers."""
        return all(self.processes.pid_of(d) is not None for d in self._daemons()
                   if d.name in ("mariadb", "slurmdbd")) and munge_works()

    @staticmethod
    def _require_root() -> None:
        if os.geteuid() != 0:
            raise TestbedError(
                "the Slurm testbed must run as root (it starts slurmd, munged and MariaDB); "
                "rerun with sudo or as root"
            )

    # -------------------------------------------------------------- daemons
    def _daemons(self) -> list[Daemon]:
        return testbed_daemons(self.root, self.nodes, has_accounting(self.release))

    def _daemon(self, name: str) -> Daemon:
        return next(d for d in self._daemons() if d.name == name)

    def _spawn(self, daemon: Daemon) -> int:
        return self.processes.spawn(daemon)

    def _start_slurmdbd(self) -> None:
        self._log("starting slurmdbd")
        d = self._daemon("slurmdbd")
        self._spawn(d)
        port = self.ports.dbd
        self.processes.wait(f"waiting for slurmdbd on port {port}", lambda: port_open(port), d)

    def _start_slurmctld(self) -> None:
        self._log("starting slurmctld")
        d = self._daemon("slurmctld")
        self._spawn(d)
        self.processes.wait("waiting for slurmctld to answer `scontrol ping`", self._ctld_answers, d)

    def stop_slurmctld(self) -> None:
        """Stop the controller only (fault tests): jobs and their steps keep running on the slurmd."""
        self.processes.stop_group([self._daemon("slurmctld")])

    def restart_slurmctld(self) -> None:
        """Start the controller again keeping its saved state (no -c), so running jobs are still known."""
        d = self._daemon("slurmctld")
        d = Daemon(d.name, [a for a in d.argv if a != "-c"], d.exe)
        self._log("restarting slurmctld (state kept)")
        self._spawn(d)
        self.processes.wait("waiting for the restarted slurmctld to answer `scontrol ping`", self._ctld_answers, d)

    def crash_node(self, node: str) -> list[int]:
        """Kill `node` as a crash would (launcher.testbed.crash): its slurmd, then its step daemons and every
        task on it, all with SIGKILL. Returns the pids killed; Slurm finds out only by its pings."""
        if node not in self.nodes:
            raise TestbedError(f"no node {node!r} on this testbed (its nodes: {', '.join(self.nodes)})")
        slurmd = self._daemon(f"slurmd-{node}")
        pid = self.processes.pid_of(slurmd)
        killed = [pid] if pid is not None else []
        crash.kill_all(killed)
        stepds, tasks = crash.node_processes(node)
        crash.kill_all(stepds + tasks)
        self._log(f"crashed {node}: slurmd {pid or '(not running)'}, {len(stepds)} step daemon(s), {len(tasks)} task(s)")
        return killed + stepds + tasks

    def revive_node(self, node: str) -> None:
        """Start a crashed node's slurmd again; with ReturnToService=2 Slurm takes the node back into
        service once it registers."""
        slurmd = self._daemon(f"slurmd-{node}")
        if self.processes.pid_of(slurmd) is None:
            self._log(f"reviving {node}")
            self._spawn(slurmd)

    def _start_slurmds(self) -> None:
        self._log(f"starting {len(self.nodes)} slurmd ({', '.join(self.nodes)}; GPUs {','.join(map(str, self.gpus))})")
        for node in self.nodes:
            self._spawn(self._daemon(f"slurmd-{node}"))

    def _wait_nodes_idle(self, deadline: float) -> None:
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for d in self._daemons():
                self.processes.check_alive(d, "waiting for the nodes to become idle")
            states = self.node_states()
            if sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.2)
        raise TestbedError(
            f"timed out waiting for {len(self.nodes)} idle nodes (sinfo says {states or 'nothing'}); "
            + self.processes.log_hint()
        )

    def _ctld_answers(self) -> bool:
        r = subprocess.run(["scontrol", "ping"], env=self._full_env(), capture_output=True, text=True)
        return r.returncode == 0 and "UP" in r.stdout

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
        stopped = self.processes.stop_groups(groups)
        if not quiet:
            self._log("stopped " + (", ".join(stopped) if stopped else "nothing (was not running)"))

    def _stop_slurm(self) -> None:
        """Stop the slurmd (every shape's) and then slurmctld; munged, MariaDB and slurmdbd stay."""
        daemons = self._daemons()
        self.processes.stop_groups([[d for d in daemons if d.name.startswith("slurmd-")], [self._daemon("slurmctld")]])
