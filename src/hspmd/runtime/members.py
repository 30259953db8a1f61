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
=================  =========================================================================

The launcher side is ``Members``: a death (``died``) or a stale heartbeat (``stale``: no
progress for ``hang_timeout_s``; the launcher kills that process first, so a member
declared dead is dead) writes ``dead/M`` and the next generation.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "Death",
    "Members",
    "gen_key",
    "read_death",
    "read_generation",
]

PREFIX = "elastic/"


def gen_key(gen: int) -> str:
    return f"{PREFIX}gen/{gen}"


def key(*parts: object) -> str:
    """``key("commit", 2, 5)`` -> ``"elastic/commit/2/5"``."""
    return PREFIX + "/".join(map(str, parts))


@dataclass(frozen=True, slots=True)
class Death:
    """Why and when member ``member`` left: ``cause`` is ``"exit"`` (the process ended,
    ``exitcode`` negative for a signal) or ``"hang"`` (no progress for the hang timeout:
    killed by the launcher). ``failed_at``: the failure's time as best known (the injected
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
        how = "hung" if self.cause == "hang" else f"died (exit code {self.exitcode})"
        return f"rank {self.member} {how} in {self.phase} of step {self.step}"


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
    ) -> None:  # fmt: skip
        """``members``: this launcher's (it watches them); ``everyone``: the members of
        generation 0 to publish (default: ``members``; None: another launcher of the job
        publishes it)."""
        self.store = store
        self.alive = list(members)
        self.spares = list(spares)  # started, outside every generation until a growth
        self.grown = 0  # growth requests served
        self.hang_timeout_s = hang_timeout_s
        if everyone is not None:
            first = list(everyone) or self.alive
            self.store.set(gen_key(0), json.dumps({"members": first, "dead": []}))
            self.store.set(key("gen"), "0")

    def _advance(
        self, change: Callable[[list[int]], list[int]], *, dead: int | None = None
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
                "dead": record["dead"] + ([] if dead is None else [dead]),
            }
            if self.store.compare_set(key("claim", gen + 1), "", token) == token:
                self.store.set(gen_key(gen + 1), json.dumps(new))
                self.store.set(key("gen"), str(gen + 1))
                return
            self.store.wait([gen_key(gen + 1)])  # another launcher's: build on it

    def died(self, member: int, *, cause: str, exitcode: int | None) -> Death:
        """Publish member's death and the generation without it."""
        now = time.time()
        beat = _heartbeat(self.store, member)
        phase, step, failed_at = "setup", 0, now
        if beat is not None:
            progress, phase, step = beat
            if cause == "hang":
                failed_at = progress
        if self.store.check([key("dying", member)]):  # an injected failure stamps itself
            stamp, phase, text = self.store.get(key("dying", member)).decode().split()
            failed_at, step = float(stamp), int(text)
        death = Death(member, cause, exitcode, phase, step, failed_at, now)
        self.store.set(key("dead", member), json.dumps(asdict(death)))
        self.alive.remove(member)
        self._advance(lambda members: [m for m in members if m != member], dead=member)
        return death

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
        self._advance(lambda members: sorted(members + joining))

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
