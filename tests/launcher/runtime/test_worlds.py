"""Process-group worlds kept across migrations (Worlds.join keep=True), with real processes and
real gloo groups: a world is kept only when its members are the same and every member asks to keep it."""
from __future__ import annotations

import subprocess
import sys

from tests.paths import ROOT
from tests.migrate.spawned import run_spawned


def _members(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    from launcher.runtime.worlds import Worlds
    from launcher.wire.control import Control

    worlds = Worlds(Control("127.0.0.1", port, server=rank == 0, secret="test-worlds"))
    out = {}

    def summed() -> float:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return float(t)

    worlds.join("a", [0, 1], rank, 30, abort_key="abort/a")
    first = _get_default_group()
    # same members in another order, both ask: kept; ranks in the group stay those of world a
    out["b_rank"] = worlds.join("b", [1, 0], rank, 30, abort_key="abort/b", keep=True)
    out["b_kept"] = _get_default_group() is first
    out["b_world_ranks"] = worlds.ranks([1, 0])
    out["b_sum"] = summed()
    # only one member asks: a new group for both (neither waits for the other in the old one)
    worlds.join("c", [0, 1], rank, 30, abort_key="abort/c", keep=rank == 0)
    third = _get_default_group()
    out["c_kept"] = third is first
    out["c_sum"] = summed()
    # without a meeting on the store (no abort key) nothing can be agreed: never kept
    worlds.join("d", [0, 1], rank, 30, keep=True)
    out["d_kept"] = _get_default_group() is third
    out["d_sum"] = summed()
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, out))


def test_a_world_is_kept_only_when_every_member_asks_and_the_members_are_the_same() -> None:
    got = run_spawned(_members, 2)
    for rank in (0, 1):
        out = got[rank]
        assert out["b_rank"] == [1, 0].index(rank)
        assert out["b_kept"] is True and out["b_world_ranks"] == [1, 0]
        assert out["c_kept"] is False and out["d_kept"] is False
        assert out["b_sum"] == out["c_sum"] == out["d_sum"] == 3.0


def _retired(rank: int, port: int, queue) -> None:
    import threading

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    from launcher.runtime.worlds import Worlds
    from launcher.wire.control import Control

    worlds = Worlds(Control("127.0.0.1", port, server=rank == 0, secret="test-worlds"))
    out = {}
    worlds.join("a", [0, 1], rank, 30, abort_key="abort/a")
    first = _get_default_group()
    sub = dist.new_group([0, 1])  # a mesh's subgroup of world a
    worlds.join("b", [1, 0], rank, 30, abort_key="abort/b")  # another world, not kept
    # world a's groups left the registry but were not torn down inside the migration: still held
    out["held"] = [g is first or g is sub for g in worlds.retired].count(True)
    out["default_is_new"] = _get_default_group() is not first
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sum"] = float(t)
    worlds.drop_retired()  # once the new world trains: torn down in the background
    out["after_drop"] = len(worlds.retired)
    for th in threading.enumerate():
        if th.name == "retire-worlds":
            th.join(30)
    out["threads_left"] = sum(th.name == "retire-worlds" for th in threading.enumerate())
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, out))


def test_a_world_left_is_torn_down_only_after_the_new_one_runs() -> None:
    got = run_spawned(_retired, 2)
    assert got[0] == got[1] == {"held": 2, "default_is_new": True, "sum": 3.0, "after_drop": 0, "threads_left": 0}


# A new interpreter (as srun starts a worker) that leaves world a for world b, drops a's groups once b
# ran, and ends at once. Next to a's real gloo groups the retired list holds an object that takes
# 0.5 s to tear down and then says so in a file: a daemon thread still tearing down when the process
# ends is stopped by the interpreter's finalization (with gloo's groups: an abort, exit -6).
_ENDS_AFTER_A_MIGRATION = """
import sys, time
import torch, torch.distributed as dist
from launcher.runtime.worlds import Worlds
from launcher.wire.control import Control

class SlowTeardown:
    def __del__(self):
        time.sleep(0.5)
        with open(sys.argv[1], "w") as f:
            f.write("torn down")

worlds = Worlds(Control("127.0.0.1", 0, server=True))
worlds.join("a", [0], 0, 30, abort_key="abort/a")
dist.new_group([0])
worlds.join("b", [0], 0, 30, abort_key="abort/b")
worlds.retired.append(SlowTeardown())
t = torch.ones(4)
dist.all_reduce(t)
worlds.drop_retired()
worlds.join("c", [0], 0, 30, abort_key="abort/c")  # retired, never dropped: torn down before the end
dist.destroy_process_group()
sys.exit(3)
"""


def test_a_worker_that_ends_right_after_a_migration_waits_for_the_old_worlds_teardown(tmp_path):
    done = tmp_path / "torn-down"
    p = subprocess.run([sys.executable, "-c", _ENDS_AFTER_A_MIGRATION, str(done)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 3, p.stderr  # its own exit status, not an abort
    assert done.read_text() == "torn down"  # the teardown ran to its end before the process ended
