"""The error for a task list that cannot finish: which tasks never ran, and one wait cycle.

A task that never ran waits on a dep or a stream predecessor that never ran either (a
resource holder always finishes), so following unfinished predecessors from any stuck task
must come back to a task already seen: that loop is the cycle the message names. Stream
edges follow the list order, so every loop holds at least one dep on a later task, e.g.
``ar0`` (ranks 0, 1) listed before ``ar1`` (ranks 0, 1) with ``deps=("ar1",)``::

    'ar0' waits for 'ar1' (dep)
    'ar1' waits for 'ar0' (stream comm of rank 0 has 'ar0' first)
"""

from __future__ import annotations

from collections.abc import Sequence

from hspmd.sim.engine import _MAX_NAMED, SimError, Task


def _waits(tasks: Sequence[Task], done: Sequence[bool]) -> dict[int, list[tuple[int, str]]]:
    """For every stuck task, its unfinished predecessors with the reason in words."""
    index = {t.id: i for i, t in enumerate(tasks)}
    waits: dict[int, list[tuple[int, str]]] = {i: [] for i, ok in enumerate(done) if not ok}
    last_on: dict[tuple[int, str], int] = {}
    for i, t in enumerate(tasks):
        for p in t.participants:
            prev = last_on.get((p, t.stream))
            last_on[p, t.stream] = i
            if i in waits and prev is not None and not done[prev]:
                waits[i].append(
                    (prev, f"stream {t.stream} of rank {p} has {tasks[prev].id!r} first")
                )
        if i in waits:
            waits[i] += [(index[d], "dep") for d in t.deps if not done[index[d]]]
    return waits


def _cycle(waits: dict[int, list[tuple[int, str]]]) -> list[tuple[int, int, str]]:
    """One loop of (waiter, waited-for, reason) found by following first predecessors."""
    order: dict[int, int] = {}
    steps: list[tuple[int, int, str]] = []
    i = min(waits)
    while i not in order:
        order[i] = len(steps)
        assert waits[i], f"stuck task {i} waits on nothing"
        j, why = waits[i][0]
        steps.append((i, j, why))
        i = j
    return steps[order[i] :]


def stuck_error(tasks: Sequence[Task], done: Sequence[bool]) -> SimError:
    """A ``SimError`` naming the tasks that never ran and one cycle among them."""
    waits = _waits(tasks, done)
    stuck = sorted(waits)
    named = ", ".join(repr(tasks[i].id) for i in stuck[:_MAX_NAMED])
    more = f" and {len(stuck) - _MAX_NAMED} more" if len(stuck) > _MAX_NAMED else ""
    cycle = _cycle(waits)
    loop = "; ".join(f"{tasks[a].id!r} waits for {tasks[b].id!r} ({why})" for a, b, why in cycle)
    kind = "a dep cycle" if all(why == "dep" for _, _, why in cycle) else "a deadlock"
    return SimError(
        f"{kind}: {len(stuck)} of {len(tasks)} tasks never ran ({named}{more}); "
        f"{loop}. Fix: make deps acyclic, and let no task depend on one that is queued after "
        "it (or after a collective it waits for) on the same stream"
    )
