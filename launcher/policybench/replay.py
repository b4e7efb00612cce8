"""One run of a trace on the Slurm testbed: an elastic job on one policy, the plain jobs submitted on time.

The elastic job is `elastic-launch` of the reference GPT (pp2, DP over up to 4 nodes x 2 GPUs, `--nnodes 1:4`,
started on 1 node), the plain jobs are `sbatch --exclusive` sleeps. While the trace plays, the queue is sampled
every SAMPLE_S (launcher.policybench.measure); afterwards the elastic job is cancelled and its history and
loss file read. Nothing here decides anything: it submits, watches and reads.
"""
from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launcher.policybench.measure import Sample, sample_steps, utilisation, wait_figures, waits
from launcher.policybench.trace import PlainJob

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_S = 0.5
ELASTIC_NAME = "bench-elastic"
PLAIN_PREFIX = "bench-plain-"
UNFINISHED = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED")  # squeue lists ended jobs too
RUN_S_MAX = 60.0  # a plain job's longest run (trace.RUN_S) plus its wait, per job, before the run gives up


@dataclass(frozen=True)
class Knobs:
    """The elastic job's policy knobs, scaled to a compressed trace (a few minutes stand for a day)."""

    idle_s: float = 5.0
    dwell_s: float = 10.0
    max_per_hour: int = 360
    step_sleep: float = 0.1


@dataclass
class RunResult:
    policy: str
    window_s: float = 0.0
    utilisation: float = 0.0
    plain_waits: dict[int, float | None] = field(default_factory=dict)
    median_wait_s: float | None = None
    max_wait_s: float | None = None
    never_started: int = 0
    steps: int = 0
    replica_steps: int = 0
    every_step_once: bool = False
    resizes: list[dict] = field(default_factory=list)  # the policy's migrations: to, status, bit_exact, pause, duration
    yields: list[dict] = field(default_factory=list)  # plain job a yield was for, its wait
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def elastic_script(policy: str, workdir: Path, url: str, loss_file: Path, knobs: Knobs) -> str:
    return f"""#!/bin/bash
#SBATCH --nodes=1 --ntasks-per-node=2 --gres=gpu:2 --no-kill --job-name={ELASTIC_NAME} --output={workdir}/batch.out --chdir={workdir}
export PYTHONPATH={ROOT}
exec {sys.executable} -m launcher.launch --nnodes 1:4 --gpus-per-node 2 --layouts pp2dp4,pp2dp3,pp2dp2,pp2dp1 \\
    --placement resilient --policy {policy} --policy-idle {knobs.idle_s} --policy-dwell {knobs.dwell_s} \\
    --policy-max-per-hour {knobs.max_per_hour} --checkpoint-every 0 --db {url} --log-dir {workdir}/logs \\
    -- python -m launcher.worker --layers 4 --hidden 128 --vocab 512 --log-every 0 --loss-file {loss_file} \\
    --steps 100000000 --step-sleep {knobs.step_sleep}
"""


def plain_script(job: PlainJob) -> str:
    return (f"#!/bin/bash\n#SBATCH --nodes={job.nodes} --exclusive --job-name={PLAIN_PREFIX}{job.index} "
            f"--output=/dev/null\nsleep {job.run_s}\n")


class Sampler(threading.Thread):
    """The queue every SAMPLE_S: every RUNNING job's node count (Slurm's word)."""

    def __init__(self, slurm, t0: float) -> None:
        super().__init__(daemon=True)
        self.slurm, self.t0, self.samples, self.failures = slurm, t0, [], 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                jobs = self.slurm.jobs()
                self.samples.append(Sample(time.monotonic() - self.t0,
                                           {j.job_id: j.num_nodes for j in jobs if j.state == "RUNNING"}))
            except Exception:  # noqa: BLE001 -- a busy slurmctld: one sample fewer, counted
                self.failures += 1
            self.stopping.wait(SAMPLE_S)


def read_loss_rows(path: Path) -> list[tuple[int, float, str]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                rows.append((int(parts[0]), float(parts[1]), parts[2]))
    return rows


def wait_until(what: str, check: Callable[[], object], timeout: float, every: float = 0.5):
    """Poll `check` every `every` s until it returns something true (returned); TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def _all_idle(slurm, nodes: int) -> bool:
    states = [n.state for n in slurm.nodes()]
    return len(states) >= nodes and all(s == "idle" for s in states)


def run_policy(policy: str, trace: Sequence[PlainJob], seconds: float, env: dict, workdir: Path, knobs: Knobs,
               total_nodes: int, say: Callable[[str], None]) -> RunResult:
    """Play `trace` with the elastic job on `policy`; the cluster is left idle afterwards."""
    from launcher.backends.slurm.client import SlurmCommands

    slurm, out = SlurmCommands(env=env), RunResult(policy)
    workdir.mkdir(parents=True, exist_ok=True)
    url, loss_file = f"sqlite:///{workdir}/e.db", workdir / "loss.txt"
    wait_until("every testbed node idle", lambda: _all_idle(slurm, total_nodes), 180)
    elastic = slurm.submit(elastic_script(policy, workdir, url, loss_file, knobs))
    plain: dict[int, float] = {}
    sampler = None
    try:
        wait_until("the elastic job's first steps", lambda: len(read_loss_rows(loss_file)) >= 3, 240)
        say(f"bench-policy [{policy}]: elastic job {elastic} training; playing {len(trace)} plain jobs over "
            f"{seconds:.0f} s")
        t0 = time.monotonic()
        sampler = Sampler(slurm, t0)
        sampler.start()
        for job in trace:
            time.sleep(max(0.0, t0 + job.at_s - time.monotonic()))
            plain[slurm.submit(plain_script(job))] = time.monotonic() - t0
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        wait_until("every plain job to end", lambda: not any(j.job_id in plain and j.state in UNFINISHED
                                                        for j in slurm.jobs()), max(RUN_S_MAX * len(trace), 120))
        out.window_s = round(time.monotonic() - t0, 1)
    except Exception as exc:  # noqa: BLE001 -- the run's figures say it failed, and why
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        if sampler is not None:
            sampler.stopping.set()
            sampler.join(5)
        for job_id in [*plain, elastic]:
            try:
                slurm.cancel(job_id)
            except Exception:  # noqa: BLE001 -- already gone
                pass
    samples = sampler.samples if sampler is not None else []
    out.utilisation = round(utilisation(samples, total_nodes, 0.0, out.window_s), 3)
    out.plain_waits = waits(plain, samples)
    figures = wait_figures(out.plain_waits)
    out.median_wait_s, out.max_wait_s, out.never_started = figures.median_s, figures.max_s, figures.never_started
    rows = read_loss_rows(loss_file)
    out.steps, out.replica_steps = sample_steps(rows)
    out.every_step_once = [s for s, _l, _lay in rows] == list(range(1, len(rows) + 1))
    _read_history(url, out)
    wait_until("every testbed node idle again", lambda: _all_idle(slurm, total_nodes), 180)
    return out


def _read_history(url: str, out: RunResult) -> None:
    from db import Store

    store = Store(url, create=False)
    try:
        job = store.find_job(ELASTIC_NAME)
        rows = store.history(job=job.id, limit=1000) if job is not None else []
    finally:
        store.close()
    for r in sorted(rows, key=lambda r: r["id"]):
        if r["trigger"] != "policy":
            continue
        out.resizes.append({k: r[k] for k in ("from_layout", "to_layout", "status", "bit_exact", "pause_s",
                                               "duration_s", "bytes_moved")})
        for note in r["notes"]:
            found = re.search(r"job (\d+) \(", note)
            if found and int(found.group(1)) in out.plain_waits:
                out.yields.append({"plain_job": int(found.group(1)),
                                   "plain_wait_s": out.plain_waits[int(found.group(1))], "pause_s": r["pause_s"]})
