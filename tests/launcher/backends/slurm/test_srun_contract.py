"""srun's contract in restart mode: a script written for `srun python train.py` (ranks from SLURM_* only,
as Lightning's SLURMEnvironment and submitit read them) trains with the right ranks and world on every
resize. The oracle is real `srun` on the same testbed: the variables a world of the same shape gets
from `srun --nodes=K --ntasks-per-node=2` are the ones elastic-launch's workers see.

The pure part (which variables a node carries) is checked without Slurm at the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.loop.restart import srun_world_env, tasks_per_node
from launcher.runtime.torchrun_exec import rank_env
from tests.examples.test_slurm_examples import Run
from tests.launcher.conftest import slurm_testbed  # noqa: F401 -- the shared session fixture

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = ROOT / "tests" / "examples" / "srun_script.py"
COMPARED = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
            "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_NODELIST",
            "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_GTIDS")


def _rows(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _srun_oracle(testbed, tmp_path: Path, nodes: str) -> dict[int, dict]:
    """What real srun gives a world of 2 tasks on each of `nodes`: rank -> the compared variables."""
    log = tmp_path / f"oracle-{nodes}.jsonl"
    count = len(nodes.split(","))
    subprocess.run(["srun", f"--nodes={count}", f"--nodelist={nodes}", "--ntasks-per-node=2", "--gres=gpu:2",
                    sys.executable, str(SCRIPT), "--log", str(log)],
                   env={**os.environ, **testbed.env(), "PYTHONPATH": str(ROOT)}, check=True, timeout=120,
                   capture_output=True)
    return {int(r["env"]["SLURM_PROCID"]): {k: r["env"][k] for k in COMPARED} for r in _rows(log)}


@pytest.mark.slurm
@pytest.mark.slurm_core
def test_a_script_written_for_srun_gets_the_worlds_ranks_on_every_resize(slurm_testbed, tmp_path) -> None:
    log, pace = tmp_path / "ranks.jsonl", tmp_path / "pace"
    pace.touch()
    run = Run(slurm_testbed, tmp_path, "srun-contract", "--term-timeout 20",
              f"../tests/examples/srun_script.py --log {log} --sleep-while {pace}", nodes=2)
    try:
        run.wait(lambda: len(_rows(log)) >= 4, "4 ranks on 2 nodes", timeout=150)
        run.resize(1, 1)
        run.wait(lambda: len(_rows(log)) >= 6, "2 ranks on 1 node")
        run.resize(2, 2)
        run.wait(lambda: len(_rows(log)) >= 10, "4 ranks on 2 nodes again")
        pace.unlink()
        run.finish()
    finally:
        run.cancel()
    worlds: dict[str, list[dict]] = {}
    for row in _rows(log):
        worlds.setdefault(row["restart"], []).append(row)
    assert sorted(len(w) for w in worlds.values()) == [2, 4, 4], worlds
    for rows in worlds.values():
        size = len(rows)
        nodes = sorted({r["env"]["SLURMD_NODENAME"] for r in rows})
        # every rank once, every task agreeing on the world (the process group formed with these ranks)
        assert sorted(int(r["env"]["SLURM_PROCID"]) for r in rows) == list(range(size))
        assert all(r["peers"] == list(range(size)) for r in rows)
        oracle = _srun_oracle(slurm_testbed, tmp_path, ",".join(nodes))
        for r in rows:
            rank = int(r["env"]["SLURM_PROCID"])
            assert {k: r["env"][k] for k in COMPARED} == oracle[rank], (rank, r["env"], oracle[rank])
            lightning = r["lightning"]
            assert lightning == {"detect": True, "world_size": size, "global_rank": rank,
                                 "local_rank": int(r["env"]["SLURM_LOCALID"]),
                                 "node_rank": int(r["env"]["SLURM_NODEID"])}, lightning


def test_the_variables_a_node_carries_are_the_worlds() -> None:
    carried = srun_world_env(["n1", "n2", "n3"], 1, [2, 2, 1])
    env = {"SLURM_JOB_ID": "7", "SLURM_LOCALID": "1", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "ELASTIC_RANK_BASE": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", **carried}
    got = rank_env(env)
    assert (got["SLURM_PROCID"], got["RANK"], got["SLURM_LOCALID"], got["SLURM_NODEID"], got["SLURM_NTASKS"],
            got["SLURM_NNODES"], got["SLURM_GTIDS"], got["SLURM_STEP_NODELIST"], got["SLURM_TASKS_PER_NODE"]) == \
        ("3", "3", "1", "1", "5", "3", "2,3", "n[1-3]", "2(x2),1")
    assert "SLURM_NTASKS_PER_NODE" not in got  # uneven nodes: srun sets it only for --ntasks-per-node
    assert "SLURM_PROCID" not in rank_env({k: v for k, v in env.items() if k != "SLURM_JOB_ID"})  # not on Slurm
    assert tasks_per_node([4]) == "4" and tasks_per_node([2, 1, 1, 3]) == "2,1(x2),3"
