"""Checkpoints of a live-mode job (launcher.runtime): the state a live migration moves, written with DCP.

What is written is this rank's manifest (migrate.manifest), piece by piece: every tensor of the
model's `state_dict` and the optimizer's per-parameter state (`optim.state.<fqn>.<key>`), as a
DTensor on the stage's (dp, fsdp, tp) mesh -- Replicate over DP, Shard(dim) over TP and FSDP where the
manifest cuts it (FSDP2's cut of a TP shard's dim 0 as FSDP2 places it, _StridedShard) -- so DCP writes
each piece once and a load on another layout reads only the slices it
needs (a job suspended on tp2dp2 resumes on tp2dp1). This holds the same for DTensor models
(parallelize_module) and for models that shard themselves (the reference GPT's plain local shards),
because both are described by their manifest; with pipeline parallelism each stage writes the FQNs
it owns (they are global names, so a load on another split finds them). Beside them: every
registered object's `state_dict()` (`run.extras`), the optimizer's settings and the declared LR
scheduler's state (`run.runtime`: a restore goes on with the schedule) and the number of finished steps. Folders follow
launcher.wire.folders' convention: DIR/.tmp-step-<S> while it is written, renamed to DIR/step-<S> by
rank 0 once every rank's part is on disk; a restore only ever reads a `step-<S>`.

Two ways to write: `save` (a suspend: every rank at one boundary, synchronously, then the workers
end) and `Safety` (the periodic safety checkpoint, $ELASTIC_CHECKPOINT_EVERY, in the background:
training waits only for the in-memory copy of the state, then goes on while a thread writes it).
"""
from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future

from launcher.wire.folders import checkpoint_paths, finalize_checkpoint
from launcher.runtime.faults import die_at

#: how long a background write (and its gloo group's collectives) may take before it is dropped
WRITE_TIMEOUT_S = 300.0
JOIN_S = 30.0  # a write whose result is set has only its return left; never wait on it for long


def failures() -> tuple[type[BaseException], ...]:
    """What a failed checkpoint save or load raises: DCP's CheckpointException derives from BaseException,
    not Exception, so `except Exception` lets it end the script (a peer dying during a background write
    then killed every survivor instead of dropping that write)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def placements(e, tp: int) -> tuple:
    """Where piece `e` (migrate.manifest.ShardEntry) lies on a stage's (dp, fsdp, tp) mesh of TP size `tp`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list = [Replicate(), Replicate(), Replicate()]
    tp_dims = set()
    for i, (dim, _index, _count) in enumerate(e.cuts):
        axis = e.axis_of(i)
        if axis == "tp":
            tp_dims.add(dim)
        out[{"fsdp": 1, "tp": 2}[axis]] = _StridedShard(dim, split_factor=tp) if axis == "fsdp" and dim in tp_dims \
            else Shard(dim)
    return tuple(out)


def _pieces(local: Mapping[str, object], manifest, mesh, copy: bool = False) -> dict:
    """FQN -> DTensor over `mesh` (dims dp, fsdp, tp) wrapping this rank's local tensor (no copy), or with
    copy=True a copy of it in host memory that training may not change (a background write's input)."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for e in manifest.entries:
        shape = torch.Size(e.shape)
        t = DTensor.from_local(local[e.fqn], mesh, placements(e, mesh.size(2)), run_check=False, shape=shape,
                               stride=torch.empty(shape, device="meta").stride())
        if copy:  # on a GPU straight to host memory; 0-dim ones too (Adam's step is updated in place)
            t = t.detach().clone() if t.device.type == "cpu" else t.detach().to("cpu")
        out[e.fqn] = t
    return out


#: the prefix of the runtime's own registered objects (launcher.runtime.job: the optimizer's settings, the
#: declared scheduler), written under `run.runtime` apart from the script's `run.extras`
RUNTIME_PREFIX = "runtime."


def _split(objects: Mapping[str, object]) -> tuple[dict, dict]:
    """(the script's objects, the runtime's): a checkpoint's `run.extras` holds exactly what the script
    registered, as it always did, so a reader of it (or a checkpoint written before) sees no change."""
    runtime = {k: v for k, v in objects.items() if k.startswith(RUNTIME_PREFIX)}
    return {k: v for k, v in objects.items() if k not in runtime}, runtime


def _state(local, manifest, mesh, objects: Mapping[str, object], step: int, copy: bool = False) -> dict:
    script, runtime = _split(objects)
    return {"state": _pieces(local, manifest, mesh, copy),
            "run": {"step": step, "extras": pickle.dumps({k: v.state_dict() for k, v in script.items()}),
                    "runtime": pickle.dumps({k: v.state_dict() for k, v in runtime.items()})}}


def save(root: str, local: Mapping[str, object], manifest, mesh, extras: Mapping[str, object], step: int,
         rank: int) -> str:
    """Every rank of the training world calls it at the same step boundary with its local tensors by FQN
    (launcher.runtime's export) and its manifest; returns the final folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tmp, final = checkpoint_paths(root, step)
    dcp.save(_state(local, manifest, mesh, extras, step), checkpoint_id=str(tmp))
    dist.barrier()  # every rank's part is on disk before the folder is published
    if rank == 0:
        finalize_checkpoint(root, step)
    return str(final)


class Safety:
    """The background safety checkpoints of one live-mode worker (Job owns one).

    Why this shape: a synchronous DCP save stops every rank for the whole disk write at every N-th
    step. Here `start` (every rank of the world at the same boundary) copies this rank's pieces and
    the registered objects' state, and a thread writes them with DCP over a gloo group of its own
    (made once per process-group world), so its collectives never interleave with training's. One
    write at a time: the next `start` first waits for the one before. `poll` at every boundary and
    `settle` before anything changes the world (an event, leaving) finish it: when DCP's save
    returned on a rank, every rank's files and the metadata are on disk (its last collective comes
    after the metadata is written), so rank 0 then publishes it (launcher.wire.folders.finalize_checkpoint)
    keeping the complete one before it -- the launcher may have chosen that one for a restore a moment
    earlier. A write that fails (a peer died, the world was cut) is dropped: its .tmp folder is never
    read, the complete one before stays.

    Fault injection for tests: $ELASTIC_FAULT = "DEVICE:ckpt[:N]" SIGKILLs the worker inside the write of
    the first checkpoint of a step >= N, after its own files, before the metadata (a crash mid-write).
    """

    def __init__(self, root: str | None, log: Callable[[str], None], fault=None) -> None:
        self.root, self.log, self.fault = root, log, fault
        self.pending: tuple[Future, int, bool, threading.Thread] | None = None  # (write, step, publisher?, thread)
        self._group = self._world = None  # the writes' gloo group and the default group it was made in
        self._t0 = 0.0  # when the write in flight started

    def start(self, step: int, rank: int, local: Mapping[str, object], manifest, mesh,
              extras: Mapping[str, object]) -> None:
        """Copy the state of `step` (finished steps) and write it in the background; every rank of the
        training world calls it at the same boundary. `local` are views (launcher.runtime's export)."""
        import shutil
        import time

        self.settle()
        t0 = time.perf_counter()
        group = self._writes_group()
        tmp, _final = checkpoint_paths(self.root, step)
        if rank == 0:  # a write of this step that never finished (the job went back to an older one since)
            # safe before the others write: rank 0's own save creates the folder again before the planning
            # collective, and no rank writes a byte before that collective
            shutil.rmtree(tmp, ignore_errors=True)
        state = _state(local, manifest, mesh, extras, step, copy=True)
        fut: Future = Future()
        writing = threading.Thread(target=_write, args=(fut, state, self._writer(tmp, step), group), daemon=True,
                                   name=f"safety-checkpoint-{step}")
        writing.start()
        self.pending = (fut, step, rank == 0, writing)
        self._t0 = time.perf_counter()
        if rank == 0:  # what training waited for (a figure for the logs, not a promise)
            self.log(f"safety checkpoint of step {step}: state copied in {self._t0 - t0:.3f} s, writing")

    def poll(self) -> None:
        """At a step boundary: publish the write in flight if it finished (never waits)."""
        if self.pending is not None and self.pending[0].done():
            self.settle()

    def settle(self, timeout: float = WRITE_TIMEOUT_S) -> str | None:
        """Finish the write in flight (rank 0 publishes it); returns the published folder, if any."""
        if self.pending is None:
            return None
        fut, step, publisher, writing = self.pending
        self.pending = None
        try:
            fut.result(timeout=timeout)
        except failures() as exc:  # any failure drops this checkpoint, the one before stays
            self.log(f"safety checkpoint of step {step} dropped: {type(exc).__name__}: {str(exc)[:200]}")
            return None
        finally:
            if fut.done():
                # the thread ends here, not in the interpreter's teardown: its last references (the staged
                # copies, the writes' gloo group) go with it, and a gloo group destroyed by a daemon thread
                # while a fresh interpreter finalizes aborts it ('terminate called without an active
                # exception', exit -6, after a job's last step: the launcher then restores and replays)
                writing.join(JOIN_S)
        if not publisher:
            return None
        try:
            path = finalize_checkpoint(self.root, step, keep_previous=True)
        except OSError as exc:  # the folder stays temporary (never restored); training goes on
            self.log(f"safety checkpoint of step {step} not published: {exc}")
            return None
        import time

        self.log(f"safety checkpoint {path} (published {time.perf_counter() - self._t0:.3f} s after the copy)")
        return path

    def _writes_group(self):
        """A gloo group of the whole training world for the background writes (made with the world's
        first checkpoint; every rank reaches that boundary, so the collective new_group is safe)."""
        from datetime import timedelta

        import torch.distributed as dist

        world = dist.group.WORLD
        if self._world is not world:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=WRITE_TIMEOUT_S))
            self._world = world
        return self._group

    def _writer(self, path, step: int):
        from torch.distributed.checkpoint import FileSystemWriter

        if not (self.fault and self.fault[0] == "ckpt"):
            return FileSystemWriter(str(path))
        fault, log = self.fault, self.log

        class DyingWriter(FileSystemWriter):
            def write_data(self, plan, planner):
                fut = super().write_data(plan, planner)
                fut.wait()  # this rank's files are written; the metadata is not
                die_at(fault, "ckpt", step, log)
                return fut

        return DyingWriter(str(path))


def _write(fut: Future, state: dict, writer, group) -> None:
    """The background thread: DCP save of the staged copies (every rank's thread takes part)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(state, storage_writer=writer, process_group=group)
    except BaseException as exc:  # noqa: BLE001 -- handed to whoever settles it
        fut.set_exception(exc)
    else:
        fut.set_result(None)


def load(path: str, local: Mapping[str, object], manifest, mesh, objects: Mapping[str, object]) -> int:
    """Fill `local` (views of the model's and optimizer's tensors, built for this layout) and `objects` from
    the checkpoint `path`; every rank of the training world calls it. Returns the step it holds. The runtime's
    objects (the optimizer's settings, the scheduler: RUNTIME_PREFIX) are restored where the checkpoint has
    them, so the LR schedule goes on; a checkpoint written before it held them leaves them as they are."""
    import torch.distributed.checkpoint as dcp

    script, runtime = _split(objects)
    run = {"step": 0, "extras": b""}
    if "run.runtime" in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
        run["runtime"] = b""
    state = {"state": _pieces(local, manifest, mesh), "run": run}
    dcp.load(state, checkpoint_id=path)
    saved = pickle.loads(run["extras"])
    missing = sorted(set(script) - set(saved))
    if missing:
        raise RuntimeError(f"checkpoint {path} holds no state for the registered objects {missing}")
    kept = pickle.loads(run["runtime"]) if "runtime" in run else {}
    for k, obj in {**script, **runtime}.items():
        if k in saved or k in kept:
            obj.load_state_dict(saved[k] if k in saved else kept[k])
    return int(state["run"]["step"])
