"""Uneven nodes on the local backend (`--gpus-per-node 2,1`): the topology carries each node's GPU
count, devices are numbered node by node, TP fits every node, and a job shrinks off the small node
and grows back with bit-exact migrations recorded per node."""
from __future__ import annotations

import pytest

from launcher.backends.local import LocalNodes
from launcher.launch import main
from launcher.policy.layouts import tp_fit
from tests.launcher.test_launch_local import run_job


def test_local_nodes_number_devices_node_by_node() -> None:
    nodes = LocalNodes(4, 4, node_gpus=(4, 4, 2, 2))
    envs = [nodes.worker_env(n, i, {}) for i, n in enumerate(nodes.allocation())]
    assert [[int(e["ELASTIC_DEVICE"]) for e in node] for node in envs] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11]]
    assert [e[0]["ELASTIC_GPUS_PER_NODE"] for e in envs] == ["4", "4", "2", "2"]  # LOCAL_WORLD_SIZE per node
    assert [nodes.gpus_on(n) for n in nodes.allocation()] == [4, 4, 2, 2] and nodes.gpus_per_node == 4
    assert "4,4,2,2 devices" in nodes.describe()
    assert (tp_fit([4, 4, 2, 2]), tp_fit([4, 4]), tp_fit([3, 2])) == (2, 4, 1)


def test_dry_run_starts_each_node_with_its_own_devices(capsys) -> None:
    assert main(["--dry-run", "--backend", "local", "--nnodes", "1:3", "--gpus-per-node", "4,2,2",
                 "--", "python", "-m", "launcher.worker", "--layers", "4"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "ELASTIC_DEVICE=" in x]
    devices = [int(x.split("ELASTIC_DEVICE=")[1].split()[0]) for x in lines]
    assert devices == list(range(8))


@pytest.mark.parametrize("sizes, every", [("3,1", "100"), ("2,2", "0")])
def test_default_safety_checkpoints_follow_the_real_node_sizes(sizes, every, capsys) -> None:
    """pp2dp2 on a 3-GPU and a 1-GPU node: the big node holds 3 of the 4 ranks, so some stage has both
    replicas on it and a node loss loses state (two 2-GPU nodes survive it)."""
    assert main(["--dry-run", "--backend", "local", "--nnodes", "2", "--gpus-per-node", sizes, "--layouts", "pp2dp2",
                 "--", "python", "-m", "launcher.worker", "--layers", "4"]) == 0
    assert f"ELASTIC_CHECKPOINT_EVERY={every} " in capsys.readouterr().out


def test_launcher_decides_again_on_the_allocations_node_sizes() -> None:
    """On Slurm the node sizes are known once the backend read the allocation: without --checkpoint-every
    the launcher decides with them (here a backend of 3- and 1-GPU nodes under options that knew none)."""
    from launcher.loop.launcher import Launcher
    from launcher.options import Options
    from migrate.layout import ParallelConfig

    def opts(auto: bool) -> Options:
        return Options(2, 2, 3, [ParallelConfig.parse("pp2dp2")], ["python", "x.py"], placement="resilient",
                       checkpoint_every=0, checkpoint_auto=auto)

    assert Launcher(opts(True), LocalNodes(2, 3, node_gpus=(3, 1)), None).opts.checkpoint_every == 100
    assert Launcher(opts(False), LocalNodes(2, 3, node_gpus=(3, 1)), None).opts.checkpoint_every == 0  # given: kept


@pytest.mark.parametrize("argv, words", [
    (["--gpus-per-node", "4,x"], "counts per node like 4,4,2,2"),
    (["--gpus-per-node", "4,0"], "at least 1 per node"),
    (["--gpus-per-node", "4,2", "--backend", "slurm", "--job-id", "3"], "for the local backend"),
    (["--gpus-per-node", "4,2", "--nnodes", "1:3"], "more nodes than the 2"),
    (["--gpus-per-node", "4,2", "--local-nodes", "3"], "--local-nodes 3"),
    (["--gpus-per-node", "2,1", "--nnodes", "2", "--layouts", "pp1tp2"], "with 2 node(s) GPUs 2,1"),
])
def test_bad_uneven_options_are_one_line_errors(argv, words, capsys) -> None:
    assert main(["--dry-run", *argv, "--", "python", "-m", "launcher.worker", "--layers", "4"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_shrink_off_the_small_node_and_grow_back_bit_exact(tmp_path) -> None:
    from launcher.cli import main as elastic

    def shrink(la, url):
        assert elastic(["resize", "t", "--nodes", "1", "--db", url]) == 0

    def grow(la, url):
        assert elastic(["resize", "t", "--nodes", "2", "--db", url]) == 0

    rc, la, store, _url = run_job(tmp_path, [(2, shrink), (2, grow)], nodes=2, gpn=2, layouts="pp3,pp2",
                                  node_gpus=(2, 1), layers=6)
    assert rc == 0, [o.message for o in la.outcomes]
    assert la.topology.node_sizes == [2, 1]
    job = store.find_job("t")
    maps = store.rank_maps(job.id)
    assert [m.layout for m in maps] == ["pp3tp1dp1", "pp2tp1dp1", "pp3tp1dp1"]
    assert [sorted((e.node, e.gpu) for e in m.entries) for m in maps] == [
        [("node0", 0), ("node0", 1), ("node1", 0)], [("node0", 0), ("node0", 1)],
        [("node0", 0), ("node0", 1), ("node1", 0)]]
    assert {e.component for m in maps for e in m.entries} == {0}  # the local backend is one plain job
    assert job.max_nodes == 2  # --nnodes MAX: what a grow request may ask for (not 3 devices / 2 per node)
    assert {n.name: (n.gpus, n.component) for n in store.list_nodes(job.id)} == {"node0": (2, 0), "node1": (1, 0)}
    assert [len(r["cells"]) for r in store.placement(job.id)["grid"]] == [2, 1]  # one cell per GPU a node has
    migs = store.recent_migrations(job.id, limit=10)
    assert len(migs) == 2 and all(m.status == "succeeded" and m.bit_exact is True and m.bytes_moved > 0 for m in migs)
    assert store.launch_spec(job.id)["layouts"] == {"2": "pp2tp1dp1", "3": "pp3tp1dp1"}
