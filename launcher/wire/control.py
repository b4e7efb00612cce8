"""The control plane: a store hosted by the launcher, and the keys on it.

The server speaks torch's TCPStore protocol and answers only the job's own processes: every key below is
under the job's secret (launcher.wire.guarded_store), which a stranger's connection does not know.

Everything the launcher and the workers say to each other goes through these keys:

  model                  the worker's model spec (JSON), offered by every worker, first one wins
  shapes                 the layout shapes ("pp<P>tp<T>") the launcher may choose: live-mode workers offer their
                         state manifests for them with the model spec (launcher.runtime.join)
  hello/<dev>            a worker that uses the runtime API (launcher.runtime) started: live mode
  ready/<dev>            a worker is up and waits for events (JSON: pid, host)
  step/<dev>             the number of finished steps of a training worker (its heartbeat: rank 0 every
                         step, the others every second, and at every event and failure)
  c/<world>/<step>       the update after <step> finished steps of training world <world>: "go" or "no"
  ev/<e>                 event e (JSON): start | migrate | stop, posted by the launcher
  ev/<e>/at              the step boundary at which event e applies, agreed by the workers
  ev/<e>/res/<dev>       what a participant of event e reports back (JSON)
  suspect/<world>/<dev>  a worker's collective failed with no abort mark (its error); suspects/<world> counts them
  probe/<world>          the launcher's answer: the seconds its check of the nodes may take, or "clear"
  losses                 committed steps' losses (JSON lines [step, loss, layout]) appended by the rank that reports
                         them, cleared by the launcher once it has recorded them
  giveup                 why the workers stopped the job and what to do (one line): no recovery can help (e.g. the
                         ranks disagree on the optimizer's settings, launcher.runtime.vote)

Events are numbered 0, 1, 2 ... and every worker handles every event in order, so a worker
started later (on a node the job grows onto) catches up by reading the events it missed.

Step agreement: the launcher never guesses where training is. Each step's commit vote
(launcher.runtime.vote) tells every rank of the training world at once whether the next event is
posted (rank 0 looks, one `check`), so they all take the same boundary: after the next step. A step
that voted on nothing (the first in a world) looks itself, and the first worker to see the event
proposes `at = its finished steps + 2` with an atomic compare-and-set (`agree_at`; ranks of one
layout are at most one step apart, and a worker that has not seen the event yet finishes at most one
more step before its next look). Rank 0 records the boundary taken on `ev/<e>/at` either way. Events
marked `urgent` (recovery after a failure) apply at once.

Consistent cuts: a worker may die at any instant, so nothing that changes state is applied by
some survivors and not others. Each optimizer step commits through `c/<world>/<step>`, settled
once: "go" by rank 0 after every rank said it is ready (the vote's messages run on the training
world's own process group), "no" by a rank whose vote failed, whichever lands first
(`settle_step`; launcher.runtime.vote). Each migration commits through `decide("ev/<e>/commit")`.
A failed step sets `abort/<world>`; the launcher sets it too when it sees a worker process end.
So the survivors of a failure all hold the state of the same finished step. What a step costs the
store does not grow with the job: rank 0's few operations, and every rank's heartbeat
(`step/<dev>`) once a second, not once a step (`elastic bench-control`).

Each epoch runs in a process-group world made from a `PrefixStore` on the same TCPStore: `m<e>` for
the migration (old and new devices), `w<e>` for training on the new layout. Where the members are
the same (a grow: the migration world is the new layout's devices; a shrink: the old layout's
devices are the migration world) the worker keeps the process group (launcher.runtime.worlds, which
meets on `join/<world>` and `keep/<world>` here); the store names (commits, aborts) are per world all the same.
A migration also hands each old rank's registered objects and step count over on `ev/<e>/extra/<rank>` and
`ev/<e>/step/<rank>`.

Timeline (what a pause is made of, launcher.loop.timeline): every Control keeps wall-time marks of what
its worker did (`mark`; joining and forming a world, voting on and committing a step are marked
here), which travel with the worker's result of an event (`set_result`), and stamps its vote and
commit of the first step it commits in each training world on `tl/<world>/first/<dev>`.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

from launcher.wire.env import ENV_STORE, ENV_STORE_SECRET
from launcher.wire.guarded_store import GuardedStoreServer, new_secret

KEY_SHAPES = "shapes"
POLL_MIN_S, POLL_MAX_S = 0.0005, 0.02  # how often a waiting voter looks for the decision: first, at most


class WorldAborted(RuntimeError):
    """A process-group world could not be formed: one of its members failed first."""


class Control:
    """One connection to the control-plane store (the launcher's is the server)."""

    def __init__(self, host: str, port: int, *, server: bool = False, timeout_s: float = 300.0,
                 secret: str | None = None, on_refused: Callable[[str], None] | None = None) -> None:
        """`server`: host the store (launcher.wire.guarded_store) with `secret` (default: a new one), and put
        the secret in this process's environment, where the workers it starts find it; `on_refused` hears
        of every stranger's connection the server closed. A client's `secret` defaults to that variable."""
        import torch.distributed as dist  # here, not at module load: ~1.5 s that `elastic-launch --help` and
        # its usage errors, and every module that only needs this file's key names, need not pay
        self.host, self.port = host, port
        self.server = None
        if server:
            secret = secret or new_secret()
            self.server = GuardedStoreServer(host, port, secret, on_refused)
            self.port = self.server.port
            os.environ[ENV_STORE_SECRET] = secret
        secret = secret or os.environ.get(ENV_STORE_SECRET)
        if not secret:
            raise RuntimeError(f"${ENV_STORE_SECRET} is not set: the control plane answers only the job's own "
                               "processes, which elastic-launch starts with it in their environment")
        self.store = dist.PrefixStore(secret, dist.TCPStore(host, self.port, is_master=False, wait_for_workers=False,
                                                            timeout=timedelta(seconds=timeout_s)))
        self.device: int | None = None  # this worker's device, known once it joins a world (runtime.worlds)
        self.marks: dict[str, float] = {}  # name -> wall time (time.time()) of what this worker did
        self._first_seen: set[str] = set()  # training worlds whose first commit this worker stamped

    @classmethod
    def from_env(cls, timeout_s: float = 300.0) -> "Control":
        addr = os.environ.get(ENV_STORE)
        if not addr or ":" not in addr:
            raise RuntimeError(f"${ENV_STORE} is not set (host:port of the launcher's control plane); "
                               "workers are started by elastic-launch")
        host, port = addr.rsplit(":", 1)
        return cls(host, int(port), timeout_s=timeout_s)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- plain helpers ----------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return self.store.check([key])

    def get_json(self, key: str):
        return json.loads(self.store.get(key).decode())

    def set_json(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def _many(self, prefix: str, devices: Iterable[int]) -> dict[int, object]:
        return {d: json.loads(v.decode()) for d, v in self._values(prefix, devices).items()}

    def _values(self, prefix: str, devices: Iterable[int]) -> dict[int, bytes]:
        """device -> the value of key `prefix`+device, for the keys that exist. When all of them do (the
        launcher's polls in steady state), two round trips to the store, not two per device: polling 32
        devices one key at a time cost the launcher ~3 ms of CPU per poll, every 50-200 ms, on the cores
        the workers train and migrate on. (multi_get waits for a missing key: only the launcher itself,
        between its polls, deletes keys of the prefixes polled, ready/ on a restart.)"""
        devices = list(devices)
        keys = [f"{prefix}{d}" for d in devices]
        if keys and self.store.check(keys):
            return dict(zip(devices, self.store.multi_get(keys)))
        return {d: self.store.get(k) for d, k in zip(devices, keys) if self.has(k)}

    # -- model ------------------------------------------------------------------------------
    def offer_model(self, spec: dict) -> dict:
        """Propose the model spec; returns the one in force (the first offered)."""
        text = json.dumps(spec, sort_keys=True)
        return json.loads(self.store.compare_set("model", "", text).decode())

    def model(self) -> dict | None:
        return self.get_json("model") if self.has("model") else None

    def set_shapes(self, shapes: list[str]) -> None:
        self.set_json(KEY_SHAPES, shapes)

    def shapes(self) -> list[str] | None:
        """The layout shapes the launcher may choose (`shapes`), None before it posted them."""
        return self.get_json(KEY_SHAPES) if self.has(KEY_SHAPES) else None

    # -- membership and heartbeats -----------------------------------------------------------
    def hello(self, device: int) -> None:
        """A worker that uses the runtime API says so first (`hello/<dev>`): the job then runs in live mode."""
        self.store.set(f"hello/{device}", str(os.getpid()))

    def hellos(self, devices: Iterable[int]) -> list[int]:
        return [d for d in devices if self.has(f"hello/{d}")]

    def set_ready(self, device: int, info: dict) -> None:
        self.set_json(f"ready/{device}", info)

    def ready(self, devices: Iterable[int]) -> dict[int, dict]:
        return self._many("ready/", devices)  # type: ignore[return-value]

    def forget_workers(self, devices: Iterable[int], step: int | None = None) -> None:
        """New processes take over `devices`: old hellos and registrations go (a restore: steps start at `step`)."""
        for d in devices:
            self.store.delete_key(f"hello/{d}")
            self.store.delete_key(f"ready/{d}")
            if step is not None:
                self.set_step(d, step)

    def set_step(self, device: int, step: int) -> None:
        self.store.set(f"step/{device}", str(step))

    def report_loss(self, step: int, loss: float | None, layout: str) -> None:
        """A committed step's loss (None: a step without one, restart mode's report_step), appended to `losses`
        (one JSON line each, no answer awaited): the launcher takes every one, not only the latest it polls."""
        self.store.append("losses", json.dumps([step, loss, layout]) + "\n")

    def take_losses(self, seen: int) -> tuple[list[tuple[int, float, str]], int]:
        """The reports after the first `seen` lines of `losses`, and the `seen` for next time: 0 where the lines
        read were cleared (compare-and-set: no report came in between), else their number."""
        if not self.has("losses"):
            return [], 0
        text = self.store.get("losses").decode()
        lines = text.splitlines()
        new = [(int(step), None if loss is None else float(loss), str(layout))
               for step, loss, layout in map(json.loads, lines[seen:])]
        if text and self.store.compare_set("losses", text, "") == b"":
            return new, 0
        return new, len(lines)

    def give_up(self, why: str) -> None:
        """The workers end the job on purpose (`giveup`): the launcher stops it with `why` instead of recovering."""
        self.store.set("giveup", why)

    def given_up(self) -> str | None:
        return self.store.get("giveup").decode() if self.has("giveup") else None

    def steps(self, devices: Iterable[int]) -> dict[int, int]:
        return {d: int(v.decode()) for d, v in self._values("step/", devices).items()}

    # -- events -----------------------------------------------------------------------------
    def post(self, event: dict) -> None:
        self.set_json(f"ev/{event['epoch']}", event)

    def event(self, epoch: int) -> dict | None:
        key = f"ev/{epoch}"
        return self.get_json(key) if self.has(key) else None

    def wait_event(self, epoch: int, poll_s: float = 0.05) -> dict:
        while True:
            ev = self.event(epoch)
            if ev is not None:
                return ev
            time.sleep(poll_s)

    def agree_at(self, epoch: int, finished_steps: int) -> int:
        """The step boundary of event `epoch`: the first proposal wins (see the module docstring)."""
        return int(self.store.compare_set(f"ev/{epoch}/at", "", str(finished_steps + 2)).decode())

    def at(self, epoch: int) -> int | None:
        key = f"ev/{epoch}/at"
        return int(self.store.get(key).decode()) if self.has(key) else None

    def where_workers_are(self, epoch: int, devices: list[int]) -> str:
        """Where event `epoch` found the workers, for a migration that timed out: the step boundary they
        agreed on and each worker's finished steps (its heartbeat). A worker past the boundary kept
        training while the others migrated; one short of it is stuck in a step."""
        at, steps = self.at(epoch), self.steps(devices)
        return (f"agreed boundary: {'after step ' + str(at) if at is not None else 'none yet'}; finished steps: "
                + ", ".join(f"device {d} {steps.get(d, '-')}" for d in devices))

    def set_result(self, epoch: int, device: int, result: dict) -> None:
        """This participant's result of event `epoch`, with its marks so far (then cleared but vote and commit)."""
        self.set_json(f"ev/{epoch}/res/{device}", {**result, "marks": dict(self.marks)})
        self.marks = {k: v for k, v in self.marks.items() if k in ("voted", "committed")}

    def mark(self, name: str, when: float | None = None) -> None:
        """Note the wall time of `name` (now by default) for the timeline of the current event."""
        self.marks[name] = time.time() if when is None else when

    def formed_s(self, world: str) -> float:
        """Seconds forming process-group world `world` took by this worker's marks, not counting the wait
        for its members to arrive (a joiner waits there for the old layout's last step; launcher.loop.timeline
        shows the waits). 0 when this worker did not join it."""
        return self.marks.get(f"formed {world}", 0.0) - self.marks.get(f"met {world}", 0.0)

    def results(self, epoch: int, devices: Iterable[int]) -> dict[int, dict]:
        return self._many(f"ev/{epoch}/res/", devices)  # type: ignore[return-value]

    def reported(self, epoch: int, devices: Iterable[int]) -> bool:
        """Whether every one of `devices` has set its result of event `epoch` (one round trip)."""
        return self.store.check([f"ev/{epoch}/res/{d}" for d in devices])

    # -- all-or-nothing decisions (consistent cuts) ---------------------------------------------
    def decide(self, key: str, n: int, abort_key: str | None = None, poll_s: float = POLL_MAX_S,
               on_commit: Callable[[], None] | None = None) -> bool:
        """Vote yes on decision `key` among `n` voters; True when all n voted yes (commit), False
        when somebody vetoed (`veto`) or `abort_key` appeared first. The outcome is the same for
        every voter: the last yes-voter and any vetoer race with one atomic compare-and-set.
        `on_commit` runs once, on the voter whose yes committed the decision, right after it.

        Waiting voters poll with `check` (tens of microseconds) at a growing interval up to `poll_s`,
        never with a timed-out `TCPStore.wait`: measured with torch 2.13 on this machine, waiters
        that time out and wait again in several processes at once saw a key seconds after it was set
        (4 processes polling every 50 ms: 3.0 s; 16: 2.1 s, once never within 60 s), which made the
        ranks of one layout leave a committed step seconds apart (`elastic bench --explain`)."""
        if self.store.add(f"{key}/n", 1) >= n:
            committed = self._settle(key, "go")
            if committed and on_commit is not None:
                on_commit()
            return committed
        keys, sleep = [key], POLL_MIN_S
        while not self.store.check(keys):
            if abort_key is not None and self.store.check([abort_key]):
                return self._settle(key, "no")
            time.sleep(sleep)
            sleep = min(sleep * 2, poll_s)
        return self.store.get(key).decode() == "go"

    # -- the per-step vote's store side (launcher.runtime.vote: rank 0 settles, a failing rank too) ----------
    def settle_step(self, world: str, step: int, value: str) -> bool:
        """Settle the update after `step` finished steps of `world` to "go" or "no" unless it was settled
        already (one compare-and-set); True when it stands as "go"."""
        return self._settle(f"c/{world}/{step}", value)

    def drop_step_vote(self, world: str, step: int) -> None:
        """Forget the decision on the update after `step` finished steps in `world` (every rank is past it)."""
        self.store.delete_key(f"c/{world}/{step}")

    def stamp_commit(self, world: str, first: bool = False) -> None:
        """The wall time of a commit in `world`: `t/<world>/last` at every step, `t/<world>/first` once, so the
        launcher can tell how long a migration stopped training (`commit_times`)."""
        now = repr(time.time())
        if first:
            self.store.compare_set(f"t/{world}/first", "", now)
        self.store.set(f"t/{world}/last", now)

    def stamp_first_step(self, world: str) -> None:
        """This worker's vote and commit of its first step in `world`, from its marks (once per world)."""
        if world not in self._first_seen and self.device is not None:
            self._first_seen.add(world)
            self.set_json(f"tl/{world}/first/{self.device}", {"voted": self.marks["voted"],
                                                              "committed": self.marks["committed"]})

    def event_posted(self, epoch: int) -> bool:
        return self.has(f"ev/{epoch}")

    def first_step_marks(self, world: str, devices: Iterable[int]) -> dict[int, dict]:
        """device -> {voted, committed}: when each worker voted on and saw the commit of its first step in `world`."""
        return self._many(f"tl/{world}/first/", devices)  # type: ignore[return-value]

    def commit_times(self, world: str) -> tuple[float | None, float | None]:
        """(first, last) wall time (time.time()) a step of training world `world` committed, None if none yet."""
        out = []
        for which in ("first", "last"):
            key = f"t/{world}/{which}"
            out.append(float(self.store.get(key).decode()) if self.has(key) else None)
        return out[0], out[1]

    def veto(self, key: str) -> bool:
        """Stop decision `key` from committing; True if it had committed already (too late)."""
        return self._settle(key, "no")

    def commit_event(self, epoch: int, n: int) -> bool:
        """Vote yes on migration `epoch` committing among its `n` participants (see `decide`)."""
        return self.decide(self.commit_key(epoch), n)

    def veto_event(self, epoch: int) -> bool:
        """Stop migration `epoch` from committing (veto); True if every participant had voted yes already."""
        return self.veto(self.commit_key(epoch))

    @staticmethod
    def commit_key(epoch: int) -> str:
        """The decision on migration `epoch`: its veto also calls off forming the migration's world."""
        return f"ev/{epoch}/commit"

    def _settle(self, key: str, value: str) -> bool:
        return self.store.compare_set(key, "", value).decode() == "go"

    @staticmethod
    def abort_key(world: str) -> str:
        """The mark of training world `world` aborted (`abort_world`): forming the world waits for it too."""
        return f"abort/{world}"

    def abort_world(self, world: str) -> None:
        """Tell the members of training world `world` to abandon their current step."""
        self.store.set(self.abort_key(world), "1")

    def world_aborted(self, world: str) -> bool:
        return self.has(self.abort_key(world))

    # -- a collective failed, no worker known dead: the launcher checks the nodes and answers on probe/<world>
    def suspect(self, world: str, device: int, why: str) -> None:
        """`device` saw a collective of `world` fail with no abort mark: a peer may be gone with its node."""
        self.store.set(f"suspect/{world}/{device}", why[:300])
        self.store.add(f"suspects/{world}", 1)

    def suspect_count(self, world: str) -> int:  # one round trip
        return self.store.add(f"suspects/{world}", 0)

    def suspected(self, world: str, devices: Iterable[int]) -> list[int]:  # which of `devices` reported one
        return sorted(self._values(f"suspect/{world}/", devices))

    def set_probe(self, world: str, verdict: str) -> None:  # seconds the check may take, or "clear"
        self.store.set(f"probe/{world}", verdict)

    def probe(self, world: str) -> str | None:  # set_probe's last answer, if any
        return self.store.get(k).decode() if self.has(k := f"probe/{world}") else None

    # -- what a migration hands over besides the tensors ---------------------------------------
    def hand_over(self, epoch: int, old_rank: int, objects: bytes, step: int) -> None:
        """Old rank `old_rank`'s registered objects (serialized) and finished steps, for migration `epoch`."""
        self.store.set(f"ev/{epoch}/extra/{old_rank}", objects)
        self.store.set(f"ev/{epoch}/step/{old_rank}", str(step))

    def handed_over(self, epoch: int, old_rank: int) -> tuple[bytes, int]:
        """(objects, finished steps) old rank `old_rank` handed over in migration `epoch`."""
        objects, step = self.store.get(f"ev/{epoch}/extra/{old_rank}"), self.store.get(f"ev/{epoch}/step/{old_rank}")
        return objects, int(step.decode())

    # -- process-group worlds: the meeting on the store and the groups' own store (launcher.runtime.worlds)
    def meet(self, name: str, n: int, abort_key: str) -> bool:
        """Wait for all `n` members of world `name`; False when `abort_key` appeared first."""
        return self.decide(f"join/{name}", n, abort_key)

    def wish_keep(self, name: str) -> None:
        """Count this member's wish to keep its process group as world `name` (before it meets the others)."""
        self.store.add(f"keep/{name}", 1)

    def keep_wishes(self, name: str) -> int:
        return self.store.add(f"keep/{name}", 0)

    def world_store(self, name: str):
        """The store world `name`'s process groups rendezvous on (a prefix of this one)."""
        import torch.distributed as dist

        return dist.PrefixStore(f"world/{name}/", self.store)
