"""A worker's side of elastic runs: bounded waits that notice failures, and regrouping.

``Watch`` is installed as ``World.waiter``: every wait of the executors (collectives,
point-to-point, fused BSR) runs ``work.wait()`` in a helper thread while this thread
polls the launcher's store for a newer generation (``hspmd.runtime.members``). A gloo
``wait()`` on a dead or stopped peer cannot be interrupted (and ``is_completed()`` does
not report gloo's point-to-point work), so the helper is left behind, blocked on the old
group until that group's timeout; the caller gets ``PeerFailure`` and abandons the step.
A wait that raises (a neighbour's connection closed) is a failure once the launcher
publishes the death (``CONFIRM_S``): within milliseconds of a worker's exit, or after
``NODE_TIMEOUT_S`` for a node whose launcher died with it.

A heartbeat thread writes ``hb/M`` every ``BEAT_S``: the time of the rank's last progress
(now while it waits on peers or runs, the time it stopped otherwise), its phase and step.
A stopped process (SIGSTOP) or a rank frozen outside a wait stops progressing; after the
hang timeout the launcher kills it and publishes the next generation.

``regroup`` joins the newest generation: a rendezvous of its members in the store, then a
new default process group under the store prefix ``elastic/g<G>/pg/`` (the old groups are
kept referenced, never used again: their destructors would block on abandoned work).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from hspmd.errors import HspmdError
from hspmd.runtime.members import (
    NODE_TIMEOUT_S,
    gen_key,
    key,
    latest_generation,
    read_generation,
)
from hspmd.runtime.world import World

__all__ = ["BEAT_S", "PeerFailure", "Watch", "WatchError", "regroup"]

BEAT_S = 0.2  # heartbeat period
POLL_S = 0.01  # how often a long wait looks at the store
# how long a failed wait waits for a death record: a worker's exit is published within
# milliseconds, a whole node's after its launcher was silent for NODE_TIMEOUT_S
CONFIRM_S = NODE_TIMEOUT_S + 2.0
_FAST_S = 0.002  # waits shorter than this never touch the store

# Groups of past generations: referenced for the life of the process (module docstring).
_GRAVEYARD: list[Any] = []


class PeerFailure(HspmdError, RuntimeError):
    """A member of this rank's generation died or hung: abandon the work in flight."""

    def __init__(self, gen: int) -> None:
        super().__init__(f"generation {gen} lost a member")
        self.gen = gen
        self.detected_at = time.time()


class WatchError(HspmdError, RuntimeError):
    """A wait passed its deadline with no failure published (not survivable here)."""


class Watch:
    """This rank's failure watch (module docstring); ``gen``: its current generation."""

    def __init__(self, store: Any, member: int, *, deadline_s: float) -> None:
        self.store, self.member, self.deadline_s = store, member, deadline_s
        self.gen = 0
        self.phase, self.step = "setup", 0
        self.progress = 0.0  # 0: not watched (setup, building executables)
        self.waiting = 0
        self.frozen = False  # an injected hang: no progress from now on
        self._lock = threading.Lock()  # the main thread's client, shared with its helpers
        self._beats = client(store)  # the heartbeat's own connection: never queued behind
        self._stop = threading.Event()
        self._helper: tuple[threading.Thread, queue.SimpleQueue[Any]] | None = None
        threading.Thread(target=self._beat, daemon=True, name="hspmd-heartbeat").start()

    # -- progress -------------------------------------------------------------------------

    def enter(self, phase: str, step: int) -> None:
        """The rank starts ``phase`` of ``step`` (watched from now on)."""
        self.phase, self.step = phase, step
        self.progress = time.time()

    def unwatched(self) -> None:
        """Long local work with no peers (building executables): no hang check."""
        self.progress = 0.0

    @contextmanager
    def waiting_on_peers(self) -> Iterator[None]:
        """A wait outside ``run`` (store polling): progress, as any wait on peers."""
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1
            if not self.frozen:
                self.progress = time.time()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self.beat()
            except RuntimeError:  # the store is gone: the launcher ends the run
                return

    def beat(self) -> None:
        """Publish the heartbeat: waiting on peers is progress, computing is not."""
        if self.waiting and self.progress and not self.frozen:
            self.progress = time.time()
        self._beats.set(key("hb", self.member), f"{self.progress:.6f} {self.phase} {self.step}")

    def stop(self) -> None:
        self._stop.set()

    # -- failures -------------------------------------------------------------------------

    def failed(self) -> bool:
        """A newer generation is published: a member of ours is gone."""
        with self._lock:
            return bool(self.store.check([gen_key(self.gen + 1)]))

    def check(self) -> None:
        if self.failed():
            raise PeerFailure(self.gen)

    def wait(self, works: Sequence[Any]) -> None:
        """Wait for ``works`` (``World.waiter``); ``PeerFailure`` when a member is gone."""
        pending = [w for w in works if w is not None]
        if not pending:
            return
        if all(w.is_completed() for w in pending):  # done already: no helper needed
            try:
                for w in pending:
                    w.wait()
            except RuntimeError as error:  # completed with an error: a peer's failure?
                self._confirm(error)
            return
        self.run(lambda: [w.wait() for w in pending])

    def _submit(self, fn: Callable[[], Any]) -> tuple[threading.Event, list[Any]]:
        """Run ``fn`` on the helper thread (a new one after one was abandoned)."""
        if self._helper is None or not self._helper[0].is_alive():
            jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(jobs,), daemon=True, name="hspmd-wait")
            thread.start()
            self._helper = (thread, jobs)
        box: list[Any] = []
        done = threading.Event()
        self._helper[1].put((fn, box, done))
        return done, box

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in a helper thread, abandoned on a failure or past the deadline."""
        self.waiting += 1
        abandoned = True
        try:
            done, box = self._submit(fn)
            if not done.wait(_FAST_S):
                deadline = time.monotonic() + self.deadline_s
                while not done.wait(POLL_S):
                    self.check()
                    if time.monotonic() > deadline:
                        raise WatchError(
                            f"a wait in {self.phase} of step {self.step} ran past "
                            f"{self.deadline_s:.0f} s with every member alive: raise the "
                            "timeout or look for a deadlock"
                        )
            abandoned = False
            status, value = box[0]
            if status == "error":
                self._confirm(value)
            return value
        finally:
            if abandoned:  # the helper is blocked on dead peers: the next call gets a new one
                self._helper = None
            self.waiting -= 1
            if not self.frozen:
                self.progress = time.time()

    def _confirm(self, error: BaseException) -> None:
        """A wait raised: a failure if the launcher publishes a death soon, else ``error``."""
        deadline = time.monotonic() + CONFIRM_S
        while time.monotonic() < deadline:
            self.check()
            time.sleep(POLL_S)
        raise error

    def members(self) -> tuple[int, ...]:
        with self._lock:
            return read_generation(self.store, self.gen)

    def store_call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(store)`` under the store lock (the heartbeat thread shares the client)."""
        with self._lock:
            return fn(self.store)


def _serve(jobs: queue.SimpleQueue[Any]) -> None:
    """The helper thread: run each ``(fn, box, done)``; the result or error into ``box``."""
    while True:
        fn, box, done = jobs.get()
        try:
            box.append(("ok", fn()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            box.append(("error", error))
        finally:
            done.set()


def client(store: Any) -> Any:
    """A new connection to the TCPStore ``store`` talks to (a client is one socket: calls
    from several threads queue behind each other's blocking waits)."""
    return dist.TCPStore(store.host, store.port, None, False, timeout=store.timeout)


def _reset_default_group() -> None:
    """Forget every process group without shutting any down (their work is abandoned)."""
    world = c10d._world
    _GRAVEYARD.append((world.default_pg, dict(world.pg_map)))
    c10d._update_default_pg(None)
    for table in (
        world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
        world.pg_to_tag, world.tags_to_pg, world.pg_coalesce_state,
    ):  # fmt: skip
        table.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


def regroup(world: World, watch: Watch, *, backend: str = "gloo") -> tuple[int, ...]:
    """Join the newest generation (module docstring); returns its members. ``world``'s
    rank, size and groups become the new generation's; ``watch.gen`` its number."""
    while True:
        gen = watch.store_call(latest_generation)
        watch.gen = gen
        members = watch.members()
        if world.member not in members:
            raise WatchError(f"rank {world.member} was declared dead in generation {gen}")
        join = key("join", gen)
        count = watch.store_call(lambda s: s.add(join, 1))  # noqa: B023 - called here
        try:
            with watch.waiting_on_peers():
                while count < len(members):
                    watch.check()
                    time.sleep(POLL_S)
                    count = watch.store_call(lambda s: s.add(join, 0))  # noqa: B023
            _reset_default_group()
            rank = members.index(world.member)
            # a connection of its own: gloo's rendezvous blocks in the store while waiting
            store = dist.PrefixStore(f"elastic/g{gen}/pg/", client(world.store))
            watch.run(partial(
                dist.init_process_group, backend, store=store, rank=rank,
                world_size=len(members), timeout=world.timeout,
            ))  # fmt: skip
        except PeerFailure:
            continue  # a member of generation ``gen`` failed too: join the next one
        world.rank, world.world_size = rank, len(members)
        world.groups = {}
        return members
