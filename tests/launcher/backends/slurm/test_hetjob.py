"""elastic-launch in a heterogeneous sbatch job and in a plain job on uneven nodes, on the real testbed
in shape 4,4,2,2 (partitions gpu4 = n1,n2 and gpu2 = n3,n4; the default shape is back afterwards).

Heterogeneous: component 0 (the leader, where the batch script and the launcher run) is two 2-GPU
nodes of gpu2, component 1 one 4-GPU node of gpu4. Each component is shrunk and grown back:
component 1 goes whole (`scancel` of its own job id) and comes back through a companion job shaped
like it (gpu4, 4 GPUs); then a node of the leader component is preempted -- Slurm cannot resize a
leader component, so the node stays allocated and idle, which the migration's notes say -- and the
grow back starts workers on it again. Plain: `sbatch --exclusive` on n1,n3,n4 (4,2,2 GPUs) shrinks by
a 2-GPU node and grows back through a companion job with 2 GPUs per node.

Oracles: Slurm itself (`scontrol show -d job`, squeue) for what the job and its companions hold;
the workers' executor verifies every migrated unit's checksum (bit_exact); and every committed
step's loss against the same training run uninterrupted in one process (no step lost or repeated).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from launcher.backends.slurm.client import SlurmCommands
from launcher.cli import main as elastic
from tests.launcher.loop.test_faults import read_losses
from tests.launcher.backends.slurm.test_launch_slurm import ROOT, _open, wait
from tests.launcher.backends.slurm.test_companion_live import _cleanup, _companions, _done

pytestmark = pytest.mark.slurm
MODEL = dict(layers=12, hidden=64, heads=2, vocab=256, seq_len=32)
WORKER = ("python -m launcher.worker --layers 12 --hidden 64 --heads 2 --vocab 256 --step-sleep 0.3 --log-every 0 "
          "--collective-timeout 120")
LAUNCH = f"{sys.executable} -m launcher.launch --gpus-per-node 4 --layouts pp4tp2,pp3tp2,pp2tp2 --placement packed"


def reference_losses(steps: int) -> list[float]:
    """The same training on one process (pp1tp1dp1), never interrupted."""
    from migrate.layout import ModelSpec, ParallelConfig
    from migrate.state import initial_state
    from migrate.train import Groups, Trainer, TrainConfig

    model, cfg = ModelSpec(**MODEL), ParallelConfig.parse("pp1")
    tr = Trainer(model, cfg, 0, initial_state(model, cfg, 0, 0), [0], Groups(cfg, [0], 0), TrainConfig())
    return [tr.train_step() for _ in range(steps)]


def check_losses(loss: Path) -> None:
    rows = read_losses(loss)
    steps = [s for s, _v, _l in rows]
    assert steps == list(range(1, len(steps) + 1)), f"steps repeated or skipped: {steps}"
    for (s, v, lay), r in zip(rows, reference_losses(len(steps))):
        assert abs(v - r) <= 1e-5 * abs(r), f"step {s} on {lay}: loss {v!r} vs uninterrupted {r!r}"


def _steps(loss: Path) -> int:
    return len(loss.read_text().splitlines()) if loss.exists() else 0


def _trains_on(loss: Path, layout: str, more: int = 3) -> None:
    before = _steps(loss)
    wait(f"{more} steps on {layout}", lambda: _steps(loss) >= before + more and layout in
         loss.read_text().splitlines()[-1], timeout=60, every=0.2)


def _ask(url: str, store, job_id: int, count: int, *argv: str):
    assert elastic([*argv, "--db", url]) == 0
    req = _done(store, job_id, count, timeout=90)
    assert req.status == "done", req.message
    return store.recent_migrations(job_id)[0]


def _by_node(store, job_id: int) -> dict[str, tuple[int, int]]:
    """node -> (ranks on it, its component) in the current rank map."""
    out: dict[str, tuple[int, int]] = {}
    for e in store.current_rank_map(job_id).entries:
        ranks, _c = out.get(e.node, (0, e.component))
        out[e.node] = (ranks + 1, e.component)
    return out


def _submit(testbed, tmp_path: Path, script: str, name: str):
    """sbatch `script` (HET or PLAIN) on the testbed; returns (slurm, db url, loss file, Slurm job id,
    store, job) once the launcher registered the job and recorded its first rank map."""
    slurm = SlurmCommands(env=testbed.env())
    url = f"sqlite:///{tmp_path}/e.db"
    loss = tmp_path / "loss.txt"
    job_id = slurm.submit(script.format(tmp=tmp_path, root=ROOT, launch=LAUNCH, url=url, worker=WORKER))
    try:
        store = wait("the job in the database", lambda: _open(url), timeout=60)
        job = wait("job registered", lambda: store.find_job(name), timeout=60)
        wait("first rank map", lambda: store.current_rank_map(job.id), timeout=60)
    except BaseException:
        _cleanup(testbed, slurm, [job_id], f"{name}-companion-1")
        raise
    return slurm, url, loss, job_id, store, job


HET = """#!/bin/bash
#SBATCH --job-name=elastic-het --output={tmp}/batch.out --chdir={tmp}
#SBATCH --partition=gpu2 --nodes=2 --ntasks-per-node=2 --gres=gpu:2
#SBATCH hetjob
#SBATCH --partition=gpu4 --nodes=1 --ntasks-per-node=4 --gres=gpu:4
export PYTHONPATH={root}
exec {launch} --nnodes 2:3 --db {url} --log-dir {tmp}/logs -- {worker} --loss-file {tmp}/loss.txt
"""


def test_heterogeneous_job_shrinks_and_grows_each_component(uneven, tmp_path):
    t0 = time.monotonic()
    slurm, url, loss, job_id, store, job = _submit(uneven, tmp_path, HET, "elastic-het")
    try:
        alloc = slurm.allocation(job_id)
        lead, comp = alloc.components
        assert (lead.nodes, lead.gpus, comp.nodes, comp.gpus) == (("n3", "n4"), (2, 2), ("n1",), (4,))
        assert _by_node(store, job.id) == {"n3": (2, 0), "n4": (2, 0), "n1": (4, 1)}
        assert store.current_rank_map(job.id).layout == "pp4tp2dp1"
        _trains_on(loss, "pp4tp2dp1")

        # component 1 (one node, its batch host) goes whole: scancel of its own job id
        mig = _ask(url, store, job.id, 1, "resize", "elastic-het", "--nodes", "2")
        assert (mig.status, mig.bit_exact, mig.to_layout) == ("succeeded", True, "pp2tp2dp1")
        assert mig.plan_summary["notes"] == [f"component 1 (Slurm job {comp.job_id}) cancelled: n1 released"]
        wait("component 1 gone", lambda: len(slurm.allocation(job_id).components) == 1, timeout=30)
        assert _by_node(store, job.id) == {"n3": (2, 0), "n4": (2, 0)}
        _trains_on(loss, "pp2tp2dp1")

        # it grows back through a companion job shaped like component 1: gpu4, 4 GPUs per node
        mig = _ask(url, store, job.id, 2, "resize", "elastic-het", "--nodes", "3")
        assert (mig.status, mig.bit_exact, mig.to_layout) == ("succeeded", True, "pp4tp2dp1")
        (companion,) = _companions(slurm, "elastic-het")
        held = slurm.allocation(companion.job_id).components[0]
        assert held.partition == "gpu4" and held.gpus == (4,)
        assert _by_node(store, job.id) == {"n3": (2, 0), "n4": (2, 0), held.nodes[0]: (4, 1)}
        _trains_on(loss, "pp4tp2dp1")

        # a node of the leader component cannot be given back: it stays allocated, idle, and it says so
        mig = _ask(url, store, job.id, 3, "preempt", "elastic-het", "--nodes", "n4")
        assert (mig.status, mig.bit_exact, mig.to_layout) == ("succeeded", True, "pp3tp2dp1")
        assert mig.plan_summary["notes"] == [
            f"component 0 (Slurm job {job_id}): Slurm cannot resize a heterogeneous job's leader component; "
            "n4 stays allocated, idle"]
        assert slurm.allocation(job_id).component(0).nodes == ("n3", "n4")
        assert {n.name: n.state for n in store.list_nodes(job.id)}["n4"] == "idle"
        _trains_on(loss, "pp3tp2dp1")

        # the grow back starts workers on the idle node again, without a companion
        mig = _ask(url, store, job.id, 4, "resize", "elastic-het", "--nodes", "3")
        assert (mig.status, mig.bit_exact, mig.to_layout) == ("succeeded", True, "pp4tp2dp1")
        assert len(_companions(slurm, "elastic-het")) == 1
        assert _by_node(store, job.id)["n4"] == (2, 0)
        _trains_on(loss, "pp4tp2dp1")
        check_losses(loss)
        print(f"heterogeneous job: 4 migrations, {_steps(loss)} steps in {time.monotonic() - t0:.0f} s")
    finally:
        _cleanup(uneven, slurm, [job_id], "elastic-het-companion-1")


PLAIN = """#!/bin/bash
#SBATCH --job-name=elastic-uneven --output={tmp}/batch.out --chdir={tmp}
#SBATCH --nodes=3 --nodelist=n1,n3,n4 --exclusive
export PYTHONPATH={root}
exec {launch} --nnodes 2:3 --db {url} --log-dir {tmp}/logs -- {worker} --loss-file {tmp}/loss.txt
"""


def test_plain_job_on_uneven_nodes_shrinks_and_grows(uneven, tmp_path):
    slurm, url, loss, job_id, store, job = _submit(uneven, tmp_path, PLAIN, "elastic-uneven")
    try:
        assert slurm.allocation(job_id).gpus() == {"n1": 4, "n3": 2, "n4": 2}
        assert _by_node(store, job.id) == {"n1": (4, 0), "n3": (2, 0), "n4": (2, 0)}
        _trains_on(loss, "pp4tp2dp1")

        mig = _ask(url, store, job.id, 1, "resize", "elastic-uneven", "--nodes", "2")
        assert (mig.status, mig.bit_exact, mig.to_layout) == ("succeeded", True, "pp3tp2dp1")
        kept = slurm.allocation(job_id).gpus()
        assert len(kept) == 2 and kept["n1"] == 4, kept
        assert set(_by_node(store, job.id)) == set(kept)
        _trains_on(loss, "pp3tp2dp1")

        mig = _ask(url, store, job.id, 2, "resize", "elastic-uneven", "--nodes", "3")
        assert (mig.status, mig.bit_exact, mig.to_layout) == ("succeeded", True, "pp4tp2dp1")
        (companion,) = _companions(slurm, "elastic-uneven")
        held = slurm.allocation(companion.job_id).gpus()
        assert list(held.values()) == [2] and not set(held) & set(kept), held
        assert _by_node(store, job.id) == {**{n: (g, 0) for n, g in kept.items()}, **{n: (2, 0) for n in held}}
        _trains_on(loss, "pp4tp2dp1")
        check_losses(loss)
    finally:
        _cleanup(uneven, slurm, [job_id], "elastic-uneven-companion-1")
