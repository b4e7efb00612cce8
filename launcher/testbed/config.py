"""The testbed on paper: its shape (GPUs per node), ports, sockets and the text of slurm.conf,
gres.conf and slurmdbd.conf.

Pure functions of the root folder and the shape, so the default configuration is checked byte for
byte against the golden files every Slurm test was written against, without starting anything.
"""
from __future__ import annotations

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
HOST_RELEASE = "22.05"  # Debian 12's Slurm; other releases run in a root (launcher.testbed.roots)
#: each release's ports are 1000 above the one before, so testbeds of several releases run side by side
RELEASE_PORT_OFFSETS = {"22.05": 0, "24.11": 1000, "26.05": 2000}


@dataclass(frozen=True)
class Ports:
    """The TCP ports of one testbed: slurmctld, slurmdbd and the first slurmd (n1; n2 the next, ...)."""

    ctld: int
    dbd: int
    slurmd_base: int


def ports_for(release: str) -> Ports:
    """The ports of the testbed of Slurm `release` ('24.11')."""
    offset = RELEASE_PORT_OFFSETS.get(release)
    if offset is None:
        raise ValueError(f"no testbed ports for Slurm {release} (known: {', '.join(RELEASE_PORT_OFFSETS)})")
    return Ports(CTLD_PORT + offset, DBD_PORT + offset, SLURMD_BASE_PORT + offset)


def has_accounting(release: str) -> bool:
    """Whether the testbed of `release` runs slurmdbd and MariaDB. 22.05 needs accounting to resize a job
    more than once ("the DB index is being set"); Debian's slurmdbd 24.11 and 26.05 cannot run on the
    MariaDB 11.8 their releases ship (fatal in _check_mysql_concat_is_sane, error 5027), so those
    testbeds run without it, and what needs sacct says so there."""
    return release == HOST_RELEASE


def cgroup_conf_text(release: str) -> str | None:
    """cgroup.conf beside slurm.conf, or None for none: Slurm 23.02 and later load a cgroup plugin even
    with proctrack/linuxproc and need it disabled (the testbed runs no cgroups); 22.05 rejects `disabled`."""
    if release == HOST_RELEASE:
        return None
    return "# Written by launcher/testbed; no cgroups on the testbed.\nCgroupPlugin=disabled\n"

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
MYSQL_SOCKET_DIR = Path("/run/mysqld")
MYSQL_SOCKET = MYSQL_SOCKET_DIR / "elastic-testbed.sock"
DB_NAME = "slurm_acct_db_elastic"

INSTALL_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-slurm.sh"


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


def node_names(gpus: tuple[int, ...]) -> tuple[str, ...]:
    """n1, n2, ...: one node per entry of the shape."""
    return tuple(f"n{i + 1}" for i in range(len(gpus)))


def slurm_conf_text(root: Path, gpus: tuple[int, ...], release: str = HOST_RELEASE, rpc_limit: str = "") -> str:
    """slurm.conf of this shape and release; `rpc_limit` (e.g. `rl_bucket_size=2,rl_refill_period=10`) turns on
    Slurm's per-user RPC rate limit (SlurmctldParameters=rl_enable, 23.02 and later; root is never limited)."""
    r = root
    ports = ports_for(release)
    last_port = ports.slurmd_base + len(gpus) - 1
    nodes = f"n[1-{len(gpus)}]"
    return f"""\
# Written by launcher/testbed.py; rewritten on every `up`.
ClusterName={CLUSTER_NAME}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports.ctld}
SlurmdPort={ports.slurmd_base}
AuthType=auth/munge
AuthInfo=socket={MUNGE_SOCKET}
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
{_accounting_lines(release, ports)}JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
MessageTimeout=10
{_node_lines(gpus, ports.slurmd_base, last_port)}
PartitionName={PARTITION} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP
""" + "".join(f"PartitionName={name} Nodes={','.join(members)} MaxTime=INFINITE State=UP\n"
              for name, members in uneven_partitions(gpus).items()) + \
        (f"SlurmctldParameters=rl_enable,{rpc_limit}\n" if rpc_limit else "")


def _accounting_lines(release: str, ports: Ports) -> str:
    if not has_accounting(release):
        return "AccountingStorageType=accounting_storage/none\n"
    return ("AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
            f"AccountingStoragePort={ports.dbd}\n")


def _node_lines(gpus: tuple[int, ...], first_port: int, last_port: int) -> str:
    """One NodeName line for all nodes when they are alike (the default's exact text), else one
    per node with its own port, GPUs and CPUs (a node gets max(4, GPUs) CPUs: a task per GPU)."""
    if len(set(gpus)) == 1:
        groups = [(f"n[1-{len(gpus)}]", f"{first_port}-{last_port}", gpus[0])]
    else:
        groups = [(n, str(first_port + i), g) for i, (n, g) in enumerate(zip(node_names(gpus), gpus))]
    return "\n".join(
        f"NodeName={names} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports} "
        f"CPUs={max(CPUS_PER_NODE, g)} Sockets=1 CoresPerSocket={max(CPUS_PER_NODE, g)} ThreadsPerCore=1 "
        f"RealMemory=1024 Gres=gpu:{g} State=UNKNOWN"
        for names, ports, g in groups
    )


def gres_conf_text(root: Path, gpus: tuple[int, ...]) -> str:
    lines = ["# Fake GPUs: character devices made with mknod (c 1 3)."]
    for node, count in zip(node_names(gpus), gpus):
        files = "nvidia0" if count == 1 else f"nvidia[0-{count - 1}]"
        lines.append(f"NodeName={node} Name=gpu File={root}/dev/{node}/{files}")
    return "\n".join(lines) + "\n"


def slurmdbd_conf_text(root: Path, release: str = HOST_RELEASE) -> str:
    r = root
    port = ports_for(release).dbd
    return f"""\
# Written by launcher/testbed.py; slurmdbd reads it from SLURM_CONF's folder.
AuthType=auth/munge
AuthInfo=socket={MUNGE_SOCKET}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={port}
SlurmUser=root
DebugLevel=info
LogFile={r}/log/slurmdbd.log
PidFile={r}/run/slurmdbd.slurm.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc={DB_NAME}
"""
