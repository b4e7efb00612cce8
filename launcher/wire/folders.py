"""Checkpoint folders, the convention the launcher (which restores from them) and the workers (which write
them) share: DIR/step-<S> is complete (renamed when its write finished), DIR/.tmp-step-<S> is not, so a
crash half way through a write never leaves a folder a restore would read."""
from __future__ import annotations

import os


def checkpoint_paths(root, step: int):
    """(temporary, final) folder of the checkpoint of step `step` under `root`."""
    from pathlib import Path

    return Path(root) / f".tmp-step-{step}", Path(root) / f"step-{step}"


def latest_checkpoint(root, before: int | None = None) -> tuple[str, int] | None:
    """(path, step) of the newest complete checkpoint under `root` (of a step < `before` if given), or None."""
    from pathlib import Path

    best = None
    for p in Path(root).glob("step-*") if root and Path(root).is_dir() else ():
        tail = p.name[len("step-"):]
        if tail.isdigit() and (p / ".metadata").exists() and (best is None or int(tail) > best[1]) \
                and (before is None or int(tail) < before):
            best = (str(p), int(tail))
    return best


def finalize_checkpoint(root, step: int, keep_previous: bool = False) -> str:
    """Publish the finished temporary checkpoint of `step` and drop older ones; returns its path.
    Called once (by the layout's rank 0) after every rank's write completed.

    keep_previous=True keeps the newest complete checkpoint before `step` too (a background safety
    checkpoint: the launcher may have just chosen that one for a restore when this one is published,
    and it must still be there when the restarted workers read it). An older folder is first renamed
    to a temporary name, then deleted, so a crash half way never leaves a partial `step-<S>`."""
    import shutil

    tmp, final = checkpoint_paths(root, step)
    if final.exists():
        _drop(final)
    os.replace(tmp, final)
    older = latest_checkpoint(root, before=step) if keep_previous else None
    for p in list(final.parent.iterdir()):
        tail = next((p.name[len(pre):] for pre in ("step-", ".tmp-step-", ".old-step-") if p.name.startswith(pre)), "")
        if tail.isdigit() and int(tail) < step and (older is None or str(p) != older[0]):
            _drop(p) if p.name.startswith("step-") else shutil.rmtree(p, ignore_errors=True)
    return str(final)


def _drop(folder) -> None:
    """Delete a published checkpoint folder: renamed out of `step-*` first (atomic), then removed."""
    import shutil

    gone = folder.with_name(f".old-{folder.name}")
    os.replace(folder, gone)
    shutil.rmtree(gone, ignore_errors=True)
