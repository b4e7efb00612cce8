"""A restart-mode script that says its progress with launcher.runtime.report_step, for
tests/launcher/loop/test_restart_mode.py.

usage: python report_script.py DIR STEPS

It joins its world's rendezvous (one key per rank), goes on from its own checkpoint DIR/ckpt (written by rank 0
at every third step) and runs to step STEPS; rank 0 appends `step restart` to DIR/steps, then reports the step.
The first world stops after step 5 and waits for the launcher's restart (no timing: the test resizes it)."""
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from launcher import runtime

folder, steps = Path(sys.argv[1]), int(sys.argv[2])
rank = int(os.environ["RANK"])
dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False).set(f"rank{rank}", "1")
step = int((folder / "ckpt").read_text()) if (folder / "ckpt").exists() else 0
while step < steps:
    step += 1
    if rank == 0:
        if step % 3 == 0:
            (folder / "ckpt.tmp").write_text(str(step))
            (folder / "ckpt.tmp").rename(folder / "ckpt")
        with open(folder / "steps", "a") as f:
            f.write(f"{step} {os.environ['TORCHELASTIC_RESTART_COUNT']}\n")
        runtime.report_step(step, loss=1.0 / step)
    while step == 5 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        time.sleep(0.05)
