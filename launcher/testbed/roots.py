"""Other Slurm releases beside the host's: a Debian root per release, the project run inside it.

Why a root and not a second install: a Slurm client talks only to a controller of its own or the two
releases before, and Debian packages one Slurm per release (Debian 12: 22.05, trixie: 24.11, sid:
26.05). So `elastic testbed up --slurm 24.11` runs the whole testbed -- munged, MariaDB, slurmdbd,
slurmctld, the slurmd, and every command, job and worker they start -- inside a Debian trixie root
built from Debian's packages (scripts/install-slurm-root.sh, cached under ROOTS_DIR).

The project and its interpreter are bind-mounted into the root at their own paths: the torch wheel
installed for the host's Python (CPU) serves there too, where the root's own Python is another version
whose torch from the package index is a CUDA build. Inside the root the testbed is the ordinary one
(launcher.testbed.cluster) on the root's Slurm; it listens on ports of its own (config.ports_for), so
clusters of several releases can run side by side on one machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from launcher.testbed.errors import TestbedError

#: the Slurm releases the testbed runs, oldest first; the first is the host's own (Debian 12)
SLURM_VERSIONS = ("22.05", "24.11", "26.05")
ROOTS_DIR = Path("/var/cache/elastic-testbed/roots")
PROJECT = Path(__file__).resolve().parents[2]
ROOT_SCRIPT = PROJECT / "scripts" / "install-slurm-root.sh"
MARKER = Path("/.elastic-root")  # written by the install script: present only inside a root
STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

Log = Callable[[str], None]


def check_version(version: str) -> str:
    """`--slurm` as given, or a one-line ValueError naming the releases there are."""
    if version not in SLURM_VERSIONS:
        raise ValueError(f"--slurm {version}: the testbed runs Slurm {', '.join(SLURM_VERSIONS)}")
    return version


def inside_root() -> str | None:
    """The Slurm release of the root this process runs in (its marker's second line, 'slurm 24.11.5'),
    or None on the host."""
    try:
        return MARKER.read_text().splitlines()[1].split()[1]
    except (OSError, IndexError):
        return None


def current_release() -> str:
    """The testbed release of this machine: the root's this process runs in, else the host's."""
    here = inside_root() or ""
    return next((v for v in SLURM_VERSIONS if here.startswith(v + ".")), SLURM_VERSIONS[0])


def runs_natively(version: str | None) -> bool:
    """Whether `--slurm version` is this machine's own Slurm: none asked, the host's release on the
    host, or the root's release inside that root."""
    return version is None or version == current_release()


def root_path(version: str) -> Path:
    return ROOTS_DIR / f"slurm-{version}"


def binds() -> list[Path]:
    """Host folders the root sees at the same paths: the project (its .venv inside), the interpreter's
    installation and the virtual environment when it lives elsewhere."""
    paths = [PROJECT, Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()]
    out: list[Path] = []
    for p in paths:
        if not any(p == q or q in p.parents for q in out):
            out = [q for q in out if p not in q.parents] + [p]
    return out


def mounts_under(root: Path) -> list[str]:
    """Mount points inside `root`, as /proc/mounts lists them (deepest last)."""
    prefix = str(root).rstrip("/") + "/"
    with open("/proc/mounts") as f:
        points = [line.split()[1].replace("\\040", " ") for line in f]
    return [p for p in points if p.startswith(prefix)]


def processes_in(root: Path) -> list[int]:
    """Pids of the processes whose root directory is `root` (daemons or commands still running there)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/root") == str(root):
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


class SlurmRoot:
    """The Debian root of one Slurm release: built once, mounted while used, commands run inside."""

    def __init__(self, version: str, path: Path | None = None, log: Log | None = None) -> None:
        self.version = check_version(version)
        self.path = (path or root_path(version)).resolve()
        self.log = log or (lambda msg: print(f"[testbed] {msg}", file=sys.stderr, flush=True))

    def ensure_built(self) -> None:
        """Build the root when it is missing (about 2 minutes, once); TestbedError says why not."""
        if (self.path / MARKER.name).exists():
            return
        result = subprocess.run(["bash", str(ROOT_SCRIPT), self.version, str(self.path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in result.stdout.splitlines():
            self.log(line.removeprefix("install-slurm-root.sh: "))
        if result.returncode != 0:
            raise TestbedError(f"could not build the Slurm {self.version} root at {self.path} "
                               f"({ROOT_SCRIPT} exit {result.returncode}); see the lines above")

    def mount(self) -> None:
        """proc, /dev, /sys and the project's folders, each once (a mounted root is left as it is)."""
        have = set(mounts_under(self.path))
        plan = [(["-t", "proc", "proc"], Path("/proc")), (["--rbind", "/dev"], Path("/dev")),
                (["--rbind", "/sys"], Path("/sys"))]
        plan += [(["--bind", str(p)], p) for p in binds()]
        for how, where in plan:
            target = self.path / str(where).lstrip("/")
            if str(target) in have:
                continue
            target.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(["mount", *how, str(target)], capture_output=True, text=True)
            if done.returncode != 0:
                raise TestbedError(f"could not mount {where} into {self.path}: {done.stderr.strip()}")
        hosts = Path("/etc/hosts")
        (self.path / "etc" / "hosts").write_text(hosts.read_text())
        # other Unix users of the root (the tests' job owners) reach an interpreter under /root (pyenv's) too
        for p in binds():
            for parent in [q for q in p.parents if q != Path("/")]:
                inside = self.path / str(parent).lstrip("/")
                if inside.is_dir() and not inside.stat().st_mode & 0o001:
                    os.chmod(inside, inside.stat().st_mode | 0o011)

    def unmount(self) -> None:
        """Take every mount out of the root, unless something still runs in it (then say what)."""
        running = processes_in(self.path)
        if running:
            raise TestbedError(f"{len(running)} process(es) still run in the Slurm {self.version} root "
                               f"(pids {', '.join(map(str, running[:8]))}); run `elastic testbed down --slurm "
                               f"{self.version}` first")
        for point in reversed(mounts_under(self.path)):
            subprocess.run(["umount", "-l", point], capture_output=True)

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` with PATH of the root's tools and this project's virtual environment first."""
        env = dict(base)
        env["PATH"] = f"{Path(sys.prefix) / 'bin'}:{STANDARD_PATH}"
        return env

    def run(self, argv: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` inside the root (chroot, then cwd, which the root sees at the same path)."""
        where = str((cwd or Path.cwd()).resolve())
        root = str(self.path)

        def enter() -> None:
            os.chroot(root)
            os.chdir(where if os.path.isdir(where) else "/")

        return subprocess.run(list(argv), env=self.env(env if env is not None else os.environ),
                              preexec_fn=enter, **kwargs)

    def elastic(self, args: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """`elastic ARGS` inside the root, with this project's interpreter."""
        return self.run([sys.executable, "-m", "launcher.cli", *args], **kwargs)
