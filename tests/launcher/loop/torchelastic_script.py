"""A program written for torchrun, run by tests/launcher/loop/test_torchrun_contract.py under elastic-launch's
restart mode: `check OUT` checks the variables torchrun's agent sets, forms the world through env:// and
all-reduces; `fail` makes rank 1 raise inside torch.distributed.elastic's @record, which writes its
traceback to TORCHELASTIC_ERROR_FILE, as a torchrun user's entry point does; `fail-bare` raises the same
way without @record (PyTorch's own launcher test script), so its traceback is only in the worker's output."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

AGENT_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
              "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
              "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def check(out: str) -> None:
    missing = [k for k in AGENT_VARS if k not in os.environ]
    assert not missing, f"torchrun's agent sets {missing}"
    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    seen = {k: os.environ[k] for k in AGENT_VARS}
    seen.update(sum=t.item(), launched=dist.is_torchelastic_launched(), world=dist.get_world_size())
    with open(os.path.join(out, os.environ["RANK"]), "w") as f:
        json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()


def run() -> None:
    if sys.argv[1] == "check":
        check(sys.argv[2])
    elif os.environ["RANK"] == "1":
        raise ValueError("rank 1 is broken on purpose")
    else:
        time.sleep(1.0)  # the others are still running when rank 1 fails, as in a real job


if __name__ == "__main__":
    record(run)() if sys.argv[1] != "fail-bare" else run()
