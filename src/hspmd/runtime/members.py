"""Elastic membership: who is alive, generation by generation, in the launcher's store.

The launcher hosts the TCPStore and outlives every worker, so it is the one authority on
membership. A worker is a *member* (its launch index, fixed for the run); in generation G
it is the rank ``members(G).index(member)`` of that generation's process group. Keys, all
under ``elastic/``:

=================  =========================================================================
key                value
=================  =========================================================================
gen                the newest generation number G (text), written after ``gen/G``
gen/G              JSON ``{"members": [...], "dead": [...]}``: generation G's members
dead/M             JSON death record of member M (``Death``)
hb/M               ``"PROGRESS PHASE STEP"``: M's heartbeat (time of its last progress)
dying/M            ``"TIME PHASE STEP"``: written by an injected failure just before it acts
join/G             counter: members that reached generation G's rendezvous
commit/G/S         counter: ranks of generation G whose gradients of step S are final
loss/G/S/R         the scaled loss sum of reporter rank R in step S of generation G
plan/...           the strategy text rank 0 of a generation planned (JSON)
grow/I             JSON growth request I (rank 0): ``count`` spares and the run's position
moved/G            counter: members of G that hold the moved states
joined/M           the growth request that took spare M into a generation
node/F             JSON members of the launcher whose first member is F (several launchers)
owner/M            F: the launcher that started member M
nodebeat/F         counter: launcher F's heartbeat (``NodeBeat``, every ``NODE_BEAT_S``)
nodedone/F         launcher F finished (its heartbeat stops)
=================  =========================================================================

The launcher side is ``Members``: a death (``died``) or a stale heartbeat (``stale``: no
progress for ``hang_timeout_s``; the launcher kills that process first, so a member
declared dead is dead) writes ``dead/M`` and the next generation.

Several launchers (one per node) share one store: each beats (``NodeBeat``), and the
launcher of member 0 (``Members(..., watch_nodes=True)``) publishes every member of a
launcher whose beat stops for ``NODE_TIMEOUT_S`` as dead at once (cause ``node``). The
timeout is longer than the second in which a worker notices its launcher is gone and exits
(``hspmd.runtime.launch``), so the members of a dead node are dead when published.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "NODE_BEAT_S",
    "NODE_TIMEOUT_S",
    "Death",
    "Members",
    "NodeBeat",
    "gen_key",
    "read_death",
    "read_generation",
]

PREFIX = "elastic/"
NODE_BEAT_S = 0.1  # a launcher's heartbeat period
NODE_TIMEOUT_S = 2.0  # a launcher silent this long is gone with its node


def gen_key(gen: int) -> str:
    return f"{PREFIX}gen/{gen}"


def key(*parts: object) -> str:
    """``key("commit", 2, 5)`` -> ``"elastic/commit/2/5"``."""
    return PREFIX + "/".join(map(str, parts))


@dataclass(frozen=True, slots=True, kw_only=True)
class Death:
    """Why and when member ``member`` left: ``cause`` is ``"exit"`` (the process ended,
    ``exitcode`` negative for a signal), ``"hang"`` (no progress for the hang timeout:
    killed by the launcher) or ``"node"`` (its launcher went silent: gone with its node). ``failed_at``: the failure's time as best known (the injected
    failure's own stamp, the last progress of a hung rank, else when the launcher saw the
    exit); ``noticed_at``: when the launcher published it. Times are ``time.time()``."""

    member: int
    cause: str
    exitcode: int | None
    phase: str
    step: int
    failed_at: float
    noticed_at: float

    def describe(self) -> str:
        return f"rank {self.member} {how_lost(self.cause, self.exitcode)} in {self.phase} of step {self.step}"


def how_lost(cause: str, exitcode: int | None) -> str:
    """``hung``, ``died (exit code -9)`` or ``was lost with its node``."""
    if cause == "hang":
        return "hung"
    if cause == "node":
        return "was lost with its node (its launcher went silent)"
    return f"died (exit code {exitcode})"


def read_generation(store: Any, gen: int) -> tuple[int, ...]:
    """The members of generation ``gen`` (it must exist)."""
    return tuple(json.loads(store.get(gen_key(gen)))["members"])


def read_death(store: Any, member: int) -> Death:
    return Death(**json.loads(store.get(key("dead", member))))


def latest_generation(store: Any) -> int:
    return int(store.get(key("gen")))


def _heartbeat(store: Any, member: int) -> tuple[float, str, int] | None:
    if not store.check([key("hb", member)]):
        return None
    progress, phase, step = store.get(key("hb", member)).decode().split()
    return float(progress), phase, int(step)


class Members:
    """The launcher's record of the members alive, published generation by generation."""

    def __init__(
        self, store: Any, members: Iterable[int], *, hang_timeout_s: float,
        spares: Iterable[int] = (), everyone: Iterable[int] | None = (),
        watch_nodes: bool = False,
    ) -> None:  # fmt: skip
        """``members``: this launcher's (it watches them); ``everyone``: the members of
        generation 0 to publish (default: ``members``; None: another launcher of the job
        publishes it); ``watch_nodes``: publish the members of silent launchers as dead
        (``lost_nodes``)."""
        self.store = store
        self.alive = list(members)
        self.own = set(self.alive)
        self.spares = list(spares)  # started, outside every generation until a growth
        self.grown = 0  # growth requests served
        self.hang_timeout_s = hang_timeout_s
        self.watch_nodes = watch_nodes
        self.owners: dict[int, int] = {}  # member -> the first member of its launcher
        self.beats: dict[int, tuple[int, float]] = {}  # launcher -> (beat, seen at: monotonic)
        if everyone is not None:
            first = list(everyone) or self.alive
            self.store.set(gen_key(0), json.dumps({"members": first, "dead": []}))
            self.store.set(key("gen"), "0")

    def _advance(
        self, change: Callable[[list[int]], list[int]], *, dead: Iterable[int] = ()
    ) -> None:
        """Publish the generation after the newest with ``change(members)``. Several
        launchers may publish at once: generation G+1 goes to the one that claims
        ``claim/G+1`` first (compare-and-set), the others apply their change on top."""
        gen = int(self.store.get(key("gen")))
        token = f"{os.getpid()}:{id(self)}:{time.time()}".encode()
        while True:
            while self.store.check([gen_key(gen + 1)]):
                gen += 1
            record = json.loads(self.store.get(gen_key(gen)))
            new = {
                "members": change(record["members"]),
                "dead": record["dead"] + list(dead),
            }
            if self.store.compare_set(key("claim", gen + 1), "", token) == token:
                self.store.set(gen_key(gen + 1), json.dumps(new))
                self.store.set(key("gen"), str(gen + 1))
                return
            self.store.wait([gen_key(gen + 1)])  # another launcher's: build on it

    def died(self, member: int, *, cause: str, exitcode: int | None) -> Death:
        """Publish member's death and the generation without it."""
        death = self._record_death(member, cause=cause, exitcode=exitcode)
        self.alive.remove(member)
        self._advance(lambda members: [m for m in members if m != member], dead=[member])
        return death

    def _record_death(
        self, member: int, *, cause: str, exitcode: int | None, failed_at: float | None = None
    ) -> Death:
        now = time.time()
        beat = _heartbeat(self.store, member)
        phase, step, when = "setup", 0, now if failed_at is None else failed_at
        if beat is not None:
            progress, phase, step = beat
            if cause == "hang":
                when = progress
        if self.store.check([key("dying", member)]):  # an injected failure stamps itself
            stamp, phase, text = self.store.get(key("dying", member)).decode().split()
            when, step = float(stamp), int(text)
        death = Death(member=member, cause=cause, exitcode=exitcode, phase=phase, step=step,
                      failed_at=when, noticed_at=now)  # fmt: skip
        self.store.set(key("dead", member), json.dumps(asdict(death)))
        return death

    def lost_nodes(self) -> list[tuple[int, list[int]]]:
        """Other launchers whose beat did not change for ``NODE_TIMEOUT_S`` (and that did
        not finish), each with its members in the newest generation."""
        gen = latest_generation(self.store)
        remote = [m for m in read_generation(self.store, gen) if m not in self.own]
        by_node: dict[int, list[int]] = {}
        for member in remote:
            if member not in self.owners and self.store.check([key("owner", member)]):
                self.owners[member] = int(self.store.get(key("owner", member)))
            if member in self.owners:
                by_node.setdefault(self.owners[member], []).append(member)
        return [(node, members) for node, members in sorted(by_node.items()) if self._silent(node)]

    def _silent(self, node: int) -> bool:
        """Launcher ``node`` beat last ``NODE_TIMEOUT_S`` ago or more (by this clock: the
        beat is a counter, so the machines' clocks need not agree), and is not done."""
        if self.store.check([key("nodedone", node)]) or not self.store.check(
            [key("nodebeat", node)]
        ):
            return False
        beat, now = int(self.store.get(key("nodebeat", node))), time.monotonic()
        last = self.beats.get(node)
        if last is None or last[0] != beat:
            self.beats[node] = (beat, now)
            return False
        return now - last[1] >= NODE_TIMEOUT_S

    def node_died(self, node: int, members: list[int]) -> list[Death]:
        """Publish every member of launcher ``node`` as dead (cause ``node``) and the
        generation without them, at once."""
        since = time.time() - NODE_TIMEOUT_S
        deaths = [
            self._record_death(m, cause="node", exitcode=None, failed_at=since) for m in members
        ]
        gone = set(members)
        self._advance(lambda now: [m for m in now if m not in gone], dead=members)
        return deaths

    def generation_empty(self) -> bool:
        """The newest generation has no members (every rank of the job died)."""
        return not read_generation(self.store, latest_generation(self.store))

    def others_done(self, everyone: Iterable[int]) -> bool:
        """Every other launcher that started members of ``everyone`` finished or went
        silent (the store's host may close it)."""
        nodes = set()
        for member in everyone:
            if member in self.own:
                continue
            if member not in self.owners:
                if not self.store.check([key("owner", member)]):
                    return False  # not started yet
                self.owners[member] = int(self.store.get(key("owner", member)))
            nodes.add(self.owners[member])
        return all(self.store.check([key("nodedone", n)]) or self._silent(n) for n in nodes)

    def serve_growth(self) -> None:
        """Serve the workers' growth requests (``grow/I`` = JSON ``{"count": N, ...}``,
        numbered by the counter ``grow``): the next generation adds N spares (fewer if
        fewer are left)."""
        if not self.store.check([key("grow", self.grown)]):
            return
        request = json.loads(self.store.get(key("grow", self.grown)))
        self.grown += 1
        joining = self.spares[: request["count"]]
        del self.spares[: len(joining)]
        for member in joining:  # which request took it: its position in the run
            self.store.set(key("joined", member), str(self.grown - 1))
        self.alive = sorted(self.alive + joining)
        self.own.update(joining)
        self._advance(lambda members: sorted(members + joining))

    def describe(self, member: int) -> str:
        """``member``'s last heartbeat in words (for a launcher's time-out message)."""
        try:
            beat = _heartbeat(self.store, member)
        except RuntimeError as error:  # the store is gone: say so, keep the time-out's message
            return f"rank {member}: heartbeat unreadable ({error})"
        if beat is None:
            return f"rank {member}: no heartbeat"
        progress, phase, step = beat
        if progress <= 0:
            return f"rank {member}: {phase} of step {step}, unwatched"
        ago = time.time() - progress
        return f"rank {member}: {phase} of step {step}, last progress {ago:.1f} s ago"

    def stale(self) -> list[int]:
        """Members watched (a heartbeat with a progress time) and without progress for
        the hang timeout."""
        now = time.time()
        out = []
        for member in self.alive:
            beat = _heartbeat(self.store, member)
            if beat is not None and beat[0] > 0 and now - beat[0] > self.hang_timeout_s:
                out.append(member)
        return out


class NodeBeat:
    """A launcher's heartbeat among several (``nodebeat/F``, a counter, every
    ``NODE_BEAT_S`` on a thread with its own store connection ``store``). It registers the
    launcher's members first (``node/F``, ``owner/M``); ``done`` marks the launcher
    finished. ``lost``: the store error that stopped the beat (the store is gone)."""

    def __init__(self, store: Any, first: int, members: Iterable[int]) -> None:
        self.store, self.first = store, first
        members = list(members)
        store.set(key("node", first), json.dumps(members))
        for member in members:
            store.set(key("owner", member), str(first))
        self.count = 0
        self.lost: BaseException | None = None
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hspmd-node-beat")
        self._thread.start()

    def _beat(self) -> None:
        self.count += 1
        self.store.set(key("nodebeat", self.first), str(self.count))

    def _run(self) -> None:
        while not self._stop.wait(NODE_BEAT_S):
            try:
                self._beat()
            except RuntimeError as error:  # the store's host is gone
                self.lost = error
                return

    def done(self) -> None:
        """Mark this launcher finished, then stop beating (once)."""
        if self._stop.is_set():
            return
        if self.lost is None:
            try:
                self.store.set(key("nodedone", self.first), "1")
            except RuntimeError as error:
                self.lost = error
        self._stop.set()
        self._thread.join(1.0)
