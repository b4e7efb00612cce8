"""The process-group worlds a worker trains and migrates in (`w<e>`, `m<e>`: launcher.wire.control): forming
one, keeping the current group when every member can, and tearing left worlds down outside the pause.
Only workers form worlds, so this lives on the worker side; the meeting itself is the control plane's."""
from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Iterable
from datetime import timedelta

from launcher.wire.control import Control, WorldAborted


class Worlds:
    """This worker's process-group world, formed through its connection to the control plane."""

    def __init__(self, ctl: Control) -> None:
        self.ctl = ctl
        self.pg_members: list[int] | None = None  # devices of the process group this worker is in, by rank
        self.retired: list = []  # process groups of worlds left, not yet torn down (_retire)
        self._retiring: list[threading.Thread] = []  # teardowns of worlds dropped (drop_retired), maybe running
        self._settle_at_exit = False  # whether settle_retired runs at exit

    def join(self, name: str, members: list[int], device: int, timeout_s: float,
             abort_key: str | None = None, keep: bool = False) -> int:
        """Leave the current world (if any) and join world `name` of `members`; returns my rank in it
        (my index in `members`; `ranks(members)` gives the process-group rank of each member).

        With `abort_key`, the members first meet on the store and WorldAborted is raised when the key
        appears before all of them arrived (a member died): gloo's own rendezvous would wait out
        `timeout_s` for it.

        keep=True (with `abort_key`): when the process group this worker is in has exactly these members
        (in any order) and every member asks to keep it, it is kept as the world `name` instead of forming
        a new one (a gloo world of N processes
        takes from 0.05 s to 0.5 s on this machine to form, inside the pause). Only a caller that
        knows the group is healthy says so: after a migration committed in it, or a training
        world whose steps commit; a group whose sockets were cut is never kept."""
        import torch.distributed as dist

        ctl = self.ctl
        ctl.device = device
        ctl.mark(f"join {name}")
        rank = members.index(device)
        can_keep = keep and abort_key is not None and dist.is_initialized() and self.pg_members is not None \
            and sorted(self.pg_members) == sorted(members)
        if can_keep:
            ctl.wish_keep(name)
        if abort_key is not None and not ctl.meet(name, len(members), abort_key):
            raise WorldAborted(f"world {name}: a member did not arrive ({abort_key} set)")
        # every member's wish was counted before its vote: the group is kept only if all of them can keep it
        kept = can_keep and ctl.keep_wishes(name) == len(members)
        if dist.is_initialized() and not kept:
            self._retire()
        if kept:
            ctl.mark(f"kept {name}")  # the process group was kept (tests and the timeline can tell)
        ctl.mark(f"met {name}")
        if not kept:
            dist.init_process_group("gloo", store=ctl.world_store(name), rank=rank,
                                    world_size=len(members), timeout=timedelta(seconds=timeout_s))
            self.pg_members = list(members)
        ctl.mark(f"formed {name}")
        return rank

    def leave(self) -> None:
        """Leave the current world for good (a worker the new layout has no place for)."""
        import torch.distributed as dist

        dist.destroy_process_group()
        self.pg_members = None

    def _retire(self) -> None:
        """Leave the current world without tearing it down inside the pause: its process groups (the
        world's and its mesh's) are kept alive in `retired` past destroy_process_group, whose work is
        their destructors (joining gloo's threads, closing a socket per peer: up to 0.24 s among 24
        processes on 2 cores, and the next world forms slower meanwhile). drop_retired() lets them go.
        They are gone before the process ends (settle_retired, registered to run at exit): a gloo group
        that drop_retired's daemon thread still tears down while the interpreter finalizes aborts the
        process ("terminate called without an active exception", exit -6), and the launcher would take
        a worker that finished for one that failed; one never dropped is torn down there too, so none is
        left to the interpreter's teardown."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.retired += list(c10d._world.pg_names)
        if not self._settle_at_exit:
            self._settle_at_exit = True
            atexit.register(self.settle_retired)
        dist.destroy_process_group()
        self.pg_members = None

    def drop_retired(self) -> None:
        """Tear down the retired worlds' process groups in the background (once the new world trains).
        The process waits for that teardown before it ends (settle_retired, run at exit)."""
        if not self.retired:
            return
        groups, self.retired = self.retired, []
        teardown = threading.Thread(target=groups.clear, name="retire-worlds", daemon=True)
        self._retiring = [t for t in self._retiring if t.is_alive()] + [teardown]
        teardown.start()

    def settle_retired(self, timeout_s: float = 30.0) -> None:
        """Wait (at most `timeout_s`) for the retired worlds' teardowns to end, and tear down here any
        retired world not dropped yet. The teardown threads are daemons rather than threads the exit
        waits for without end: one that hangs (a peer's socket that never closes) lets the process end
        after `timeout_s` all the same."""
        deadline = time.monotonic() + timeout_s
        for teardown in self._retiring:
            teardown.join(max(0.0, deadline - time.monotonic()))
        self.retired.clear()

    def ranks(self, devices: Iterable[int]) -> list[int]:
        """The process-group rank of each of `devices` in the world this worker is in."""
        if self.pg_members is None:
            raise RuntimeError("not in a world (join first)")
        return [self.pg_members.index(d) for d in devices]


def forget_old_meshes() -> None:
    """Drop DTensor's sharding-propagation caches when a new world begins. They key on DeviceMesh
    equality, which ignores the process groups: a new mesh shaped like one of an earlier world (tp2dp2
    again after a grow) would get cached output specs that carry the old mesh, whose group names were
    destroyed with its world or now name other groups of the new one (seen as "Could not resolve the
    process group registered under the name N" on one rank, "Connection closed by peer" on the rest)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
