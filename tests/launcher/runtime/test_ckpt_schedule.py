"""launcher.runtime.ckpt keeps the optimizer's settings and the declared LR scheduler (the runtime's own
registered objects, `runtime.*`): a restore from a checkpoint goes on with the schedule instead of starting
it again, while the checkpoint's `run.extras` still holds exactly the script's objects, and a checkpoint
written before (no `run.runtime`) still loads. One process, a one-rank gloo world, DCP on disk; the oracle
is the same optimizer and scheduler stepped without a restore."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.optim.lr_scheduler import ExponentialLR, LinearLR, SequentialLR

from launcher.runtime import ckpt
from launcher.runtime.state import OptimizerSettings, state_views
from migrate.localrun import free_port
from migrate.manifest import module_manifest


class Position(dict):
    """A registered object of the script (a data position): its state is itself."""

    def state_dict(self) -> dict:
        return dict(self)

    def load_state_dict(self, d: dict) -> None:
        self.update(d)


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "fsdp", "tp"))  # a stage's mesh
    finally:
        dist.destroy_process_group()


def _trainer():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    sched = SequentialLR(opt, [LinearLR(opt, start_factor=0.1, total_iters=3), ExponentialLR(opt, gamma=0.8)],
                         milestones=[3])
    return model, opt, sched


def _steps(model, opt, sched, n: int) -> list[float]:
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    return lrs


def _objects(opt, sched, data, runtime: bool = True) -> dict:
    own = {"runtime.optimizer": OptimizerSettings(opt), "runtime.scheduler": sched} if runtime else {}
    return {"data": data, **own}


def test_a_restore_goes_on_with_the_lr_schedule(tmp_path: Path, mesh) -> None:
    model, opt, sched = _trainer()
    data = Position()
    _steps(model, opt, sched, 5)
    data["samples"] = 40
    path = ckpt.save(str(tmp_path), state_views(model, opt), module_manifest(model, opt), mesh,
                     _objects(opt, sched, data), 5, 0)
    want = _steps(model, opt, sched, 4)
    model2, opt2, sched2 = _trainer()
    data2 = Position()
    _steps(model2, opt2, sched2, 1)  # the state a restore fills (the runtime creates it before loading)
    step = ckpt.load(path, state_views(model2, opt2), module_manifest(model2, opt2), mesh,
                     _objects(opt2, sched2, data2))
    assert (step, data2["samples"]) == (5, 40)
    assert _steps(model2, opt2, sched2, 4) == want  # the schedule's lr of steps 6..9, not its start again
    out = tmp_path / "read.pt"
    dcp_to_torch_save(path, out)
    run = torch.load(out, weights_only=False)["run"]
    assert pickle.loads(run["extras"]) == {"data": {"samples": 40}}  # the script's objects, as before
    assert set(pickle.loads(run["runtime"])) == {"runtime.optimizer", "runtime.scheduler"}


def test_a_checkpoint_without_the_runtime_objects_still_loads(tmp_path: Path, mesh) -> None:
    model, opt, sched = _trainer()
    _steps(model, opt, sched, 2)
    path = ckpt.save(str(tmp_path), state_views(model, opt), module_manifest(model, opt), mesh,
                     _objects(opt, sched, Position(), runtime=False), 2, 0)
    model2, opt2, sched2 = _trainer()
    _steps(model2, opt2, sched2, 1)
    lr = opt2.param_groups[0]["lr"]
    assert ckpt.load(path, state_views(model2, opt2), module_manifest(model2, opt2), mesh,
                     _objects(opt2, sched2, Position())) == 2
    assert opt2.param_groups[0]["lr"] == lr and sched2.last_epoch == 1  # left as they were
