"""The job's worker processes, one handle per node: started, waited for, reaped and killed here alone,
so every mode ends a node's workers the same way and never leaves a handle behind."""
from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence

from launcher.backends import NodeBackend, NodeHandle
from launcher.loop.holdings import Holdings
from launcher.loop.outcome import MigrationFailed
from launcher.wire.contract import JOIN_CALL


_SIGNAL_MEANS = {"SIGABRT": ": an abort in C code", "SIGSEGV": ": a crash in C code",
                 "SIGKILL": ": killed (out of memory, a lost node, or a kill)"}


def exit_codes(dead: Mapping[int, int]) -> str:
    """`exit codes [-6] (SIGABRT: an abort in C code)`: the distinct codes of `dead` (device -> code), with the
    signal named where a worker was killed by one, so a user knows a crash from a script's own error or a
    kill: -N as the local backend has it (Popen's), 128+N as srun reports a task's signal on Slurm."""
    codes = sorted(set(dead.values()))
    named = []
    for code in codes:
        try:
            name = signal.Signals(-code if code < 0 else code - 128 if 128 < code < 160 else 0).name
        except ValueError:  # a script's own code, or no such signal
            continue
        named.append(name + _SIGNAL_MEANS.get(name, ""))
    return f"exit codes {codes}" + (f" ({', '.join(named)})" if named else "")


class Workers:
    """Node name -> the handle of its running workers."""

    def __init__(self, backend: NodeBackend, holdings: Holdings, log: Callable[[str], None]) -> None:
        self.backend, self.holdings, self.log = backend, holdings, log
        self.handles: dict[str, NodeHandle] = {}
        self.lost: set[int] = set()  # devices whose worker died on a node that is still up: never used again

    @property
    def active(self) -> list[str]:
        """Nodes running workers, in the allocation's order."""
        return [n for n in self.holdings.alloc if n in self.handles]

    def start(self, node: str, env: Mapping[str, str], command: Sequence[str]) -> None:
        """Start the workers of `node`; the backend numbers devices as the topology does."""
        self.handles[node] = self.backend.start(node, self.holdings.index[node], env, command)
        if self.handles[node].devices != self.holdings.node_devices(node):
            raise MigrationFailed(f"workers on {node} started as devices {self.handles[node].devices}, the topology "
                                  f"has {self.holdings.node_devices(node)}")

    def wait_ready(self, ctl, nodes: list[str], timeout: float, note: str = "") -> None:
        """Until every worker of `nodes` registered and a model spec is offered; MigrationFailed when one
        exits first or time runs out."""
        devs = [d for n in nodes for d in self.holdings.node_devices(n)]
        deadline = time.monotonic() + timeout
        while True:
            ready = ctl.ready(devs)
            if len(ready) == len(devs) and ctl.model() is not None:
                return
            for n in nodes:
                bad = {d: rc for d, rc in self.handles[n].exited().items() if d not in ready}
                if bad:
                    raise MigrationFailed(f"workers on {n}{note} exited before registering (exit codes {bad}); "
                                          f"{self.log_hint(bad)}")
            if time.monotonic() > deadline:
                late = sorted(set(devs) - set(ready))
                raise MigrationFailed(f"workers {late}{note} did not register within {timeout:.0f} s: a live-mode "
                                      f"program must call {JOIN_CALL} (or run in restart mode); {self.log_hint(late)}")
            time.sleep(0.1)

    # -- what ended ---------------------------------------------------------------------------------
    def exited(self) -> dict[int, int]:
        """device -> exit code of the workers that ended, but for those already counted as lost."""
        return {d: rc for h in self.handles.values() for d, rc in h.exited().items() if d not in self.lost}

    def dead(self, all_codes: bool = False) -> dict[int, int]:
        """device -> exit code of workers that ended (with an error, unless all_codes)."""
        return {d: rc for d, rc in self.exited().items() if all_codes or rc != 0}

    def node_gone(self, node: str) -> bool:
        """Every worker of `node` ended (its step ended), or it runs none."""
        return node not in self.handles or self.handles[node].all_exited()

    def log_hint(self, devices) -> str:
        """Where the output of these workers went, for error messages."""
        by_node: dict[str, list[int]] = {}
        for d in sorted(devices):
            by_node.setdefault(self.holdings.node_of(d), []).append(d)
        files = [str(f) for n, devs in sorted(by_node.items()) for f in self.backend.output_files(n, devs)]
        return "see " + ", ".join(files) if files else "their output went to elastic-launch's own (no --log-dir)"

    # -- ending them ----------------------------------------------------------------------------------
    def kill(self, nodes: Sequence[str]) -> None:
        """Kill the workers of `nodes` now."""
        for n in list(nodes):
            h = self.handles.pop(n, None)
            if h is not None:
                h.kill()

    def kill_all(self) -> None:
        self.kill(list(self.handles))

    def reap(self, node: str, timeout: float = 60.0) -> bool:
        """Let the workers of `node` exit on their own, then kill what is left; False when they had to be killed."""
        h = self.handles.pop(node, None)
        if h is not None and not self.backend.stop(h, timeout):
            self.log(f"workers on {node} did not exit within {timeout:.0f} s; killed them")
            return False
        return True

    def signal_all(self, sig: int) -> None:
        for h in self.handles.values():
            self.backend.signal(h, sig)
