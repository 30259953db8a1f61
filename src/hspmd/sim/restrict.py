"""A task list cut down to some ranks, for ranks the others mirror.

Where the ranks left out run exactly what some kept rank runs, at the same times (the
pipelines of one class, ``hspmd.planner.pipeline_classes``), the step can be simulated on
the kept ranks alone: a task none of whose participants is kept goes, a collective keeps
its kept participants, and a dep on a task that went (or was never built) is dropped,
since a kept task finishes at the same time. Only a caller that knows the mirror holds may
cut; nothing here checks it.

    >>> ts = [Task("f0", 0, "compute", 1.0, category="F"),
    ...       Task("f1", 1, "compute", 1.0, category="F"),
    ...       Task("ar", 0, "comm", 2.0, category="comm", deps=("f0", "f1"), ranks=(0, 1))]
    >>> [(t.id, t.rank, t.ranks, t.deps) for t in restricted(ts, {1})]
    [('f1', 1, (), ()), ('ar', 1, (), ('f1',))]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

from hspmd.sim.engine import Task

__all__ = ["restricted"]


def restricted(tasks: Iterable[Task], ranks: Collection[int]) -> list[Task]:
    """The tasks of ``tasks`` on ``ranks`` (module docstring), in their order."""
    out: list[Task] = []
    for task in tasks:
        if not task.ranks:
            if task.rank in ranks:
                out.append(task)
            continue
        kept = tuple(r for r in task.ranks if r in ranks)
        if not kept:
            continue
        if len(kept) == len(task.ranks):
            out.append(task)
            continue
        rank = task.rank if task.rank in ranks else kept[0]
        out.append(dataclasses.replace(task, rank=rank, ranks=kept if len(kept) > 1 else ()))
    ids = {t.id for t in out}
    return [
        t if all(d in ids for d in t.deps)
        else dataclasses.replace(t, deps=tuple(d for d in t.deps if d in ids))
        for t in out
    ]  # fmt: skip
