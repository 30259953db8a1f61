"""A discrete-event engine for one training step: tasks on in-order streams.

Model (docs/simulator.md has the long form):

- every rank has in-order queues called streams ("compute", "comm"); a task's position
  in its queue is the order the task list gives it;
- a collective is ONE task whose ``ranks`` name every participant: it sits on the named
  stream of each of them and starts only when it is next on all of them;
- ``deps`` are finish-to-start edges to tasks anywhere;
- ``resources`` are shared capacity-1 things (a link ``"ib:node0->node1"``, a NIC
  ``"nic:3"``) held for the whole duration; waiters are served first come first served by
  the time they became ready, ties by input order;
- ``share`` names a processor pool (``"cores:node0"``: processes sharing a host's CPU
  cores): ``duration`` is the task's time alone, and while tasks weighing ``k`` in total
  (each weighs its number of participants, or its ``weight``) run in the pool, each
  progresses at ``1 / slowdown(k)`` (``simulate(..., pools={"cores:node0": Pool(...)})``);
  a task whose duration was measured under load ``m`` (``measured_at``: a collective timed
  with its ranks active) at ``slowdown(m) / slowdown(k)``.

A task starts at max(deps finished, stream predecessor on every participant finished,
all its resources free). Worked example, unit costs, one link::

    id  rank stream  deps  resources   start end  waited for
    f0  0    compute -     -           0     1    -
    s0  0    comm    f0    ib:0->1     1     2    f0 (dep)
    s1  1    comm    -     ib:0->1     0     1    -
    f1  1    compute s0    -           2     3    s0 (dep)

Times are in seconds by convention (the trace writer converts to microseconds).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from hspmd.errors import HspmdError

__all__ = ["COMM_CATEGORIES", "Pool", "Result", "SimError", "Span", "Task", "simulate"]

#: categories counted as communication time; every other category counts as busy time.
COMM_CATEGORIES = frozenset({"comm"})

_NONE, _DEP, _STREAM, _RESOURCE = 0, 1, 2, 3
_KIND_TEXT = ("", "dep", "stream", "resource")
_MAX_NAMED = 8


class SimError(HspmdError, ValueError):
    """A task list the engine cannot run: bad values, missing deps, a cycle or deadlock."""


@dataclass(frozen=True, slots=True)
class Task:
    """One unit of work on one rank's stream (or, with ``ranks``, a collective).

    ``Task("F0", 0, "compute", 1.0, category="compute", label="F")``;
    ``Task("ar", 0, "comm", 2.0, category="comm", ranks=(0, 1, 2, 3))`` is one all-reduce
    over four ranks (``rank`` must be one of ``ranks``). ``measured_at``: the load of its
    ``share`` pool under which ``duration`` holds (1: the task alone; a collective profiled
    with its ``n`` ranks active: ``n``). ``weight``: the cores it keeps busy in the pool, its
    participants unless given (a rank emulating a device ``F`` times slower computes
    ``1/F`` of the time and sleeps the rest).
    """

    id: str
    rank: int
    stream: str
    duration: float
    _: KW_ONLY
    category: str
    deps: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()
    label: str = ""
    ranks: tuple[int, ...] = ()
    share: str = ""
    measured_at: int = 1
    weight: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration) and self.duration >= 0):
            raise SimError(
                f"task {self.id!r}: duration={self.duration!r}; give a finite value >= 0"
            )
        if not self.stream or not self.category:
            raise SimError(
                f"task {self.id!r}: stream={self.stream!r}, category={self.category!r}; both must be non-empty"
            )
        if self.weight is not None and not (math.isfinite(self.weight) and self.weight >= 0):
            raise SimError(f"task {self.id!r}: weight={self.weight!r}; give a value >= 0")
        if self.measured_at < 1:
            raise SimError(
                f"task {self.id!r}: measured_at={self.measured_at}; give a pool load >= 1"
            )
        if self.ranks and (self.rank not in self.ranks or len(set(self.ranks)) != len(self.ranks)):
            raise SimError(
                f"task {self.id!r}: rank={self.rank} ranks={self.ranks}; ranks must list each "
                "participant once and include rank"
            )

    @property
    def participants(self) -> tuple[int, ...]:
        """The ranks whose stream this task occupies: ``ranks``, or ``(rank,)``."""
        return self.ranks or (self.rank,)


@dataclass(frozen=True, slots=True)
class Pool:
    """Processors shared by the tasks naming it (``Task.share``): ``slowdown[k - 1]`` is
    how many times longer than alone a task runs while tasks weighing ``k`` run at once
    (measured: ``hspmd profile``'s core-sharing samples). Beyond the table, the last
    entry grows in proportion: ``slowdown[-1] * k / len(slowdown)``.

    >>> Pool((1.0, 1.0, 1.6, 2.0)).factor(2), Pool((1.0, 2.0)).factor(4)
    (1.0, 4.0)
    >>> round(Pool((1.0, 1.0, 1.6, 2.0)).factor(2.5), 3)
    1.3
    """

    slowdown: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.slowdown or not all(math.isfinite(f) and f >= 1.0 for f in self.slowdown):
            raise SimError(
                f"pool slowdown={self.slowdown!r}: give finite factors >= 1, k = 1, 2, ..."
            )

    def factor(self, k: float) -> float:
        """The slowdown at load ``k``, linear between the table's entries (a task may
        weigh a fraction of a core)."""
        n = len(self.slowdown)
        if k >= n:
            return self.slowdown[-1] * k / n
        low = max(int(k), 1)
        a, b = self.slowdown[low - 1], self.slowdown[min(low, n - 1)]
        return a + (b - a) * max(k - low, 0.0)


@dataclass(frozen=True, slots=True)
class Span:
    """When one task ran. ``cause`` is the task whose finish let it start, ``cause_kind``
    says through which constraint ("dep", "stream", "resource"; "" when it started at
    time 0 with nothing to wait for)."""

    task_id: str
    ranks: tuple[int, ...]
    stream: str
    category: str
    label: str
    start: float
    end: float
    cause: str = ""
    cause_kind: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start

    def __str__(self) -> str:
        ranks = ",".join(map(str, self.ranks))
        return f"{self.task_id}@r{ranks}/{self.stream}[{self.start:g},{self.end:g})"


@dataclass(frozen=True, slots=True, repr=False)
class Result:
    """Spans in input order plus per-rank totals.

    ``busy[rank]`` sums non-comm task time, ``comm[rank]`` comm task time (the two may
    overlap: streams run concurrently); ``idle[rank]`` is makespan minus the length of the
    union of all intervals in which the rank ran anything.
    """

    spans: tuple[Span, ...]
    makespan: float
    busy: dict[int, float] = field(compare=False)
    comm: dict[int, float] = field(compare=False)
    idle: dict[int, float] = field(compare=False)
    index: dict[str, int] = field(compare=False)

    def __repr__(self) -> str:
        return f"Result(tasks={len(self.spans)}, ranks={sorted(self.busy)}, makespan={self.makespan:g})"

    def span(self, task_id: str) -> Span:
        """The span of ``task_id``."""
        try:
            return self.spans[self.index[task_id]]
        except KeyError:
            raise SimError(f"no task {task_id!r} in this result") from None

    def critical_path(self) -> list[str]:
        """Task ids from time 0 to the last-finishing task, each the cause of the next."""
        if not self.spans:
            return []
        last = max(range(len(self.spans)), key=lambda i: self.spans[i].end)
        path = [self.spans[last].task_id]
        while cause := self.spans[self.index[path[-1]]].cause:
            path.append(cause)
        return path[::-1]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary: makespan, per-rank totals, time per category, critical path."""
        by_category: dict[str, float] = {}
        for s in self.spans:
            by_category[s.category] = by_category.get(s.category, 0.0) + s.duration * len(s.ranks)
        return {
            "makespan": self.makespan,
            "num_tasks": len(self.spans),
            "ranks": {
                str(r): {"busy": self.busy[r], "comm": self.comm[r], "idle": self.idle[r]}
                for r in sorted(self.busy)
            },
            "time_by_category": dict(sorted(by_category.items())),
            "critical_path": self.critical_path(),
        }


@dataclass(frozen=True, slots=True)
class _Graph:
    """The task list as integer arrays: successors coded ``index * 2 + is_stream_edge``."""

    durations: list[float]
    pending: list[int]
    succs: list[list[int]]
    resources: list[tuple[int, ...]]
    num_resources: int
    shares: list[int]  # pool index per task, -1 for none
    weights: list[float]  # the cores each task keeps busy: participants, or its weight
    bases: list[float]  # per task: its pool's slowdown at the load it was measured at
    pools: list[Pool]


def _build(tasks: Sequence[Task], pools: Mapping[str, Pool]) -> _Graph:
    index: dict[str, int] = {}
    for i, t in enumerate(tasks):
        if index.setdefault(t.id, i) != i:
            raise SimError(
                f"task id {t.id!r} is used twice (tasks {index[t.id]} and {i}); ids must be unique"
            )
    missing = [(t.id, d) for t in tasks for d in t.deps if d not in index]
    if missing:
        named = ", ".join(f"{tid!r} -> {d!r}" for tid, d in missing[:_MAX_NAMED])
        raise SimError(
            f"{len(missing)} dep(s) name no task: {named}; add those tasks or drop the deps"
        )
    n = len(tasks)
    pending = [0] * n
    succs: list[list[int]] = [[] for _ in range(n)]
    last_on: dict[tuple[int, str], int] = {}
    resource_ids: dict[str, int] = {}
    resources: list[tuple[int, ...]] = []
    for i, t in enumerate(tasks):
        for d in t.deps:
            succs[index[d]].append(i * 2)
        pending[i] = len(t.deps)
        for p in t.participants:
            prev = last_on.get((p, t.stream))
            if prev is not None:
                succs[prev].append(i * 2 + 1)
                pending[i] += 1
            last_on[p, t.stream] = i
        resources.append(
            tuple(resource_ids.setdefault(r, len(resource_ids)) for r in dict.fromkeys(t.resources))
        )
    unknown = sorted({t.share for t in tasks if t.share and t.share not in pools})
    if unknown:
        raise SimError(
            f"tasks share pools {', '.join(map(repr, unknown))} that pools= does not define: "
            "give a Pool for each"
        )
    names = list(pools)
    shares = [names.index(t.share) if t.share else -1 for t in tasks]
    weights = [float(len(t.participants)) if t.weight is None else t.weight for t in tasks]
    bases = [pools[t.share].factor(t.measured_at) if t.share else 1.0 for t in tasks]
    return _Graph(
        [t.duration for t in tasks], pending, succs, resources, len(resource_ids),
        shares, weights, bases, [pools[n] for n in names],
    )  # fmt: skip


@dataclass(slots=True)
class _Run:
    """Mutable state of one simulation (internal; never leaves ``simulate``)."""

    graph: _Graph
    starts: list[float]
    ends: list[float]
    ready_at: list[float]
    cause: list[int]
    cause_kind: bytearray
    events: list[tuple[float, int, int]] = field(default_factory=list)  # (end, task, version)
    holder: list[int] = field(default_factory=list)
    last_holder: list[int] = field(default_factory=list)
    queues: list[list[tuple[float, int]]] = field(default_factory=list)
    version: list[int] = field(default_factory=list)
    # per pool: running task -> work left (seconds alone), when last updated, its factor
    running: list[dict[int, float]] = field(default_factory=list)
    updated: list[float] = field(default_factory=list)
    factor: list[float] = field(default_factory=list)

    def start(self, i: int, t: float) -> None:
        self.starts[i] = t
        pool = self.graph.shares[i]
        if pool < 0:
            end = t + self.graph.durations[i]
            self.ends[i] = end
            heapq.heappush(self.events, (end, i, 0))
            return
        self._advance(pool, t)
        self.running[pool][i] = self.graph.durations[i]
        self._reschedule(pool)

    def _advance(self, pool: int, t: float) -> None:
        """Charge the pool's running tasks for the time since its last change."""
        elapsed = (t - self.updated[pool]) / self.factor[pool]
        left, bases = self.running[pool], self.graph.bases
        for j in left:
            left[j] = max(0.0, left[j] - elapsed * bases[j])
        self.updated[pool] = t

    def _reschedule(self, pool: int) -> None:
        left, t = self.running[pool], self.updated[pool]
        load = sum(self.graph.weights[j] for j in left)
        factor = self.graph.pools[pool].factor(load)
        self.factor[pool] = factor
        for j, work in left.items():
            self.version[j] += 1
            self.ends[j] = t + work * factor / self.graph.bases[j]
            heapq.heappush(self.events, (self.ends[j], j, self.version[j]))

    def current(self, event: tuple[float, int, int]) -> bool:
        """False for an end event a pool change has superseded."""
        return event[2] == self.version[event[1]]

    def ready(self, i: int, t: float, dirty: set[int]) -> None:
        self.ready_at[i] = t
        rs = self.graph.resources[i]
        if not rs:
            self.start(i, t)
            return
        for r in rs:
            heapq.heappush(self.queues[r], (t, i))
            dirty.add(r)

    def grant(self, dirty: set[int], t: float) -> None:
        """Start the waiters at the head of every queue whose resources are all free."""
        queues, holder = self.queues, self.holder
        heads = sorted({queues[r][0] for r in dirty if queues[r] and holder[r] < 0})
        for ready, i in heads:
            rs = self.graph.resources[i]
            if all(holder[r] < 0 and queues[r][0][1] == i for r in rs):
                for r in rs:
                    heapq.heappop(queues[r])
                    holder[r] = i
                if t > ready:
                    prev = [self.last_holder[r] for r in rs if self.last_holder[r] >= 0]
                    self.cause[i] = max(prev, key=lambda j: self.ends[j])
                    self.cause_kind[i] = _RESOURCE
                self.start(i, t)

    def finish(self, i: int, t: float, dirty: set[int]) -> None:
        self.ends[i] = t
        pool = self.graph.shares[i]
        if pool >= 0:
            self._advance(pool, t)
            del self.running[pool][i]
            self._reschedule(pool)
        for r in self.graph.resources[i]:
            self.holder[r] = -1
            self.last_holder[r] = i
            dirty.add(r)
        pending = self.graph.pending
        for code in self.graph.succs[i]:
            j = code >> 1
            pending[j] -= 1
            if pending[j] == 0:
                self.cause[j] = i
                self.cause_kind[j] = _STREAM if code & 1 else _DEP
                self.ready(j, t, dirty)


def _execute(graph: _Graph) -> _Run:
    n, m = len(graph.durations), graph.num_resources
    nan = math.nan
    run = _Run(graph, [nan] * n, [nan] * n, [nan] * n, [-1] * n, bytearray(n))
    run.holder, run.last_holder = [-1] * m, [-1] * m
    run.queues = [[] for _ in range(m)]
    run.version = [0] * n
    k = len(graph.pools)
    run.running, run.updated, run.factor = [{} for _ in range(k)], [0.0] * k, [1.0] * k
    dirty: set[int] = set()
    for i in range(n):
        if graph.pending[i] == 0:
            run.ready(i, 0.0, dirty)
    run.grant(dirty, 0.0)
    events = run.events
    while events:
        # Finish everything ending at t before granting resources at t, so that FIFO
        # order among tasks that become ready at the same time follows input order.
        if not run.current(events[0]):
            heapq.heappop(events)
            continue
        t = events[0][0]
        dirty = set()
        while events and events[0][0] == t:
            event = heapq.heappop(events)
            if run.current(event):
                run.finish(event[1], t, dirty)
        if dirty:
            run.grant(dirty, t)
    return run


def simulate(tasks: Sequence[Task], *, pools: Mapping[str, Pool] | None = None) -> Result:
    """Run ``tasks`` to completion; raise ``SimError`` on missing deps, cycles or deadlock.

    ``pools``: the processor pools tasks ``share`` (module docstring).

    >>> r = simulate([Task("a", 0, "compute", 1.0, category="compute"),
    ...               Task("b", 1, "compute", 2.0, category="compute", deps=("a",))])
    >>> r.makespan, r.critical_path(), r.idle
    (3.0, ['a', 'b'], {0: 2.0, 1: 1.0})
    """
    run = _execute(_build(tasks, pools or {}))
    if any(math.isnan(e) for e in run.ends):
        from hspmd.sim.stuck import stuck_error  # the failure path only; stuck imports us

        raise stuck_error(tasks, [not math.isnan(e) for e in run.ends])
    return _result(tasks, run)


def _result(tasks: Sequence[Task], run: _Run) -> Result:
    spans = []
    intervals: dict[int, list[tuple[float, float]]] = {}
    busy: dict[int, float] = {}
    comm: dict[int, float] = {}
    for i, t in enumerate(tasks):
        s, e, c = run.starts[i], run.ends[i], run.cause[i]
        spans.append(
            Span(t.id, t.participants, t.stream, t.category, t.label, s, e,
                 tasks[c].id if c >= 0 else "", _KIND_TEXT[run.cause_kind[i]])
        )  # fmt: skip
        totals = comm if t.category in COMM_CATEGORIES else busy
        for p in t.participants:
            intervals.setdefault(p, []).append((s, e))
            totals[p] = totals.get(p, 0.0) + (e - s)
    makespan = max(run.ends, default=0.0)
    ranks = sorted(intervals)
    idle = {r: makespan - _union_length(intervals[r]) for r in ranks}
    return Result(
        spans=tuple(spans),
        makespan=makespan,
        busy={r: busy.get(r, 0.0) for r in ranks},
        comm={r: comm.get(r, 0.0) for r in ranks},
        idle=idle,
        index={t.id: i for i, t in enumerate(tasks)},
    )


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total
