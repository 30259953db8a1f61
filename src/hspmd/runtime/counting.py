"""Count the communication a block of code issues on this rank (like DTensor's CommDebugMode).

The executors record every operation they issue on the ``World``; ``count_comm`` opens a log
for the duration of a block::

    with count_comm(world) as log:
        run_plan(plan, local, world)
    assert log.counts() == {"all_gather": 1}
    assert log.nbytes("all_gather") == local.numel() * local.element_size()

Recorded op names: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``
(collectives; bytes are this rank's input), ``send`` and ``recv`` (one per peer buffer;
bytes moved), and ``batch`` (one ``batch_isend_irecv`` call; bytes 0). Local copies are not
recorded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hspmd.runtime.world import World


@dataclass(frozen=True, slots=True)
class CommEvent:
    """One issued operation: ``all_gather group=(0, 1) bytes=64``."""

    op: str
    group: tuple[int, ...]
    nbytes: int

    def __str__(self) -> str:
        return f"{self.op} group={list(self.group)} bytes={self.nbytes}"


@dataclass(slots=True)
class CommLog:
    """The events recorded while a ``count_comm`` block was open, in issue order."""

    events: list[CommEvent] = field(default_factory=list)

    def add(self, op: str, *, group: tuple[int, ...], nbytes: int) -> None:
        self.events.append(CommEvent(op, group, nbytes))

    def counts(self) -> dict[str, int]:
        """How many operations of each kind."""
        return dict(Counter(e.op for e in self.events))

    def nbytes(self, op: str | None = None) -> int:
        """Bytes of one kind of operation, or of all of them."""
        return sum(e.nbytes for e in self.events if op is None or e.op == op)

    def __str__(self) -> str:
        return "\n".join(map(str, self.events)) or "(no communication)"


@contextmanager
def count_comm(world: World) -> Iterator[CommLog]:
    """Record what the executors issue on ``world`` inside the block (nesting allowed)."""
    log = CommLog()
    world.logs.append(log)
    try:
        yield log
    finally:
        world.logs.remove(log)
