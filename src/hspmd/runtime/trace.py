"""Record what one rank does, with aligned clocks, for a Chrome / Perfetto trace.

A ``Recorder`` keeps plain tuples in a list: ``(name, category, thread, start_ns, end_ns,
args)`` with ``time.perf_counter_ns`` times. Nothing else happens on the hot path: no
I/O, no locks, no formatting. The loop opens spans on it (``with rec.span("F", ...)``);
the runtime's executors find it on ``world.tracer`` and record one event per executed
communication step (``comm_step``), with the operations ``World.record`` reports inside
it (the same ones ``hspmd.runtime.counting`` counts)::

    rec = Recorder.start(world)          # every rank: clock sync with rank 0
    world.tracer = rec
    with rec.span("F", cat="forward", micro_batch=0):
        ...                              # comm steps inside land on thread "comm"
    part = rec.export()                  # picklable; the launcher merges every rank's

``NULL`` is the recorder of a run without tracing: ``span`` returns one shared
``nullcontext`` and records nothing.

Threads (``tid`` in the trace): 0 ``compute`` (steps, F, B, Post, switches, saves: nested
spans), 1 ``comm`` (one event per communication step; its args name the step's ``kind``,
``peers``, this rank's ``bytes`` and ``ops``, e.g. ``{"send": 2, "recv": 2, "batch": 1}``).

Clocks: ``start`` measures each rank's offset to rank 0's clock by ping-pong over the
default group (Cristian's method: of ``rounds`` exchanges the one with the shortest round
trip; the error is at most half of it, kept as ``uncertainty_ns``). Times in the trace are
microseconds since rank 0's ``start``. On one machine the offsets are ~0 (one monotonic
clock); across machines they are what makes a send and its receive line up.

Times are host times. On CPU (gloo) a span is the work itself; under nccl the kernels run
asynchronously, so a span is the time to issue them until something waits (a receive, a
collective's wait): GPU time would need CUDA events, not recorded yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from hspmd.runtime.world import World

__all__ = [
    "COMM",
    "COMPUTE",
    "NULL",
    "RankTrace",
    "Recorder",
    "Spans",
    "chrome_trace",
    "comm_span",
    "gather_parts",
    "span_on",
]

COMPUTE, COMM = 0, 1
THREAD_NAMES = {COMPUTE: "compute", COMM: "comm"}
# one event: name, category, thread, start ns, end ns (this rank's clock), args
Event = tuple[str, str, int, int, int, dict[str, Any] | None]

_NOTHING: AbstractContextManager[None] = nullcontext()


@dataclass(frozen=True, slots=True)
class RankTrace:
    """One rank's events and how to put them on rank 0's clock (what travels back)."""

    rank: int
    events: tuple[Event, ...]
    offset_ns: int  # add to this rank's perf_counter_ns to get rank 0's
    uncertainty_ns: int  # half the best round trip of the clock sync (0 on rank 0)
    origin_ns: int  # rank 0's clock at start: time 0 of the trace


class Spans(Protocol):
    """What the training loop calls: a ``Recorder``, or ``NULL`` when tracing is off."""

    @property
    def enabled(self) -> bool: ...

    def span(self, name: str, *, cat: str, **args: Any) -> AbstractContextManager[None]: ...

    def begin(self, name: str, *, cat: str, **args: Any) -> Callable[[], None]: ...


class _Span:
    __slots__ = ("rec", "name", "cat", "tid", "args", "begin")

    def __init__(
        self, rec: Recorder, name: str, cat: str, tid: int, args: dict[str, Any] | None
    ) -> None:
        self.rec, self.name, self.cat, self.tid, self.args = rec, name, cat, tid, args

    def __enter__(self) -> None:
        self.begin = time.perf_counter_ns()

    def __exit__(self, *_exc: object) -> None:
        end = time.perf_counter_ns()
        self.rec.events.append((self.name, self.cat, self.tid, self.begin, end, self.args))


class _CommStep:
    """One communication step: collects the operations issued while it is open."""

    __slots__ = ("rec", "kind", "peers", "ops", "nbytes", "begin")

    def __init__(self, rec: Recorder, kind: str) -> None:
        self.rec, self.kind = rec, kind
        self.ops: dict[str, int] = {}
        self.peers: set[int] = set()
        self.nbytes = 0

    def __enter__(self) -> None:
        self.rec.open.append(self)
        self.begin = time.perf_counter_ns()

    def __exit__(self, *_exc: object) -> None:
        end = time.perf_counter_ns()
        self.rec.open.pop()
        args = {"kind": self.kind, "peers": sorted(self.peers), "bytes": self.nbytes,
                "ops": self.ops}  # fmt: skip
        self.rec.events.append((self.kind, "comm", COMM, self.begin, end, args))


class Recorder:
    """This rank's trace events (module docstring). Make it with ``start``."""

    __slots__ = ("rank", "events", "open", "offset_ns", "uncertainty_ns", "origin_ns")

    def __init__(self, rank: int, *, offset_ns: int = 0, uncertainty_ns: int = 0,
                 origin_ns: int = 0) -> None:  # fmt: skip
        self.rank = rank
        self.events: list[Event] = []
        self.open: list[_CommStep] = []
        self.offset_ns, self.uncertainty_ns, self.origin_ns = offset_ns, uncertainty_ns, origin_ns

    @property
    def enabled(self) -> bool:
        return True

    @staticmethod
    def start(world: World, *, rounds: int = 8) -> Recorder:
        """A recorder on every rank, its clock offset to rank 0 measured (collective)."""
        offset, uncertainty, origin = _clock_sync(world, rounds=rounds)
        return Recorder(world.rank, offset_ns=offset, uncertainty_ns=uncertainty,
                        origin_ns=origin)  # fmt: skip

    def span(
        self, name: str, *, cat: str, tid: int = COMPUTE, **args: Any
    ) -> AbstractContextManager[None]:
        """A span on thread ``tid``, e.g. ``span("F", cat="forward", micro_batch=2)``."""
        return _Span(self, name, cat, tid, args or None)

    def begin(self, name: str, *, cat: str, **args: Any) -> Callable[[], None]:
        """``span`` opened now; call what it returns to close it (a span around a block
        too long to indent)."""
        span = _Span(self, name, cat, COMPUTE, args or None)
        span.__enter__()
        return lambda: span.__exit__(None, None, None)

    def comm_step(self, kind: str) -> AbstractContextManager[None]:
        """One communication step on the comm thread; the ``op`` calls inside it are its
        operations (their groups its ``peers``, this rank included)."""
        return _CommStep(self, kind)

    def op(self, op: str, group: tuple[int, ...], nbytes: int) -> None:
        """An operation ``World.record`` reports: counted in the open step, else an event
        of its own (an instant on the comm thread, e.g. the vocab-parallel loss's)."""
        if self.open:
            step = self.open[-1]
            step.ops[op] = step.ops.get(op, 0) + 1
            step.nbytes += nbytes
            step.peers.update(group)
            return
        now = time.perf_counter_ns()
        kind = op.replace("_", "-")  # named as a step kind: all_reduce -> all-reduce
        args = {"kind": kind, "peers": sorted(group), "bytes": nbytes, "ops": {op: 1}}
        self.events.append((kind, "comm", COMM, now, now, args))

    def export(self) -> RankTrace:
        return RankTrace(self.rank, tuple(self.events), self.offset_ns, self.uncertainty_ns,
                         self.origin_ns)  # fmt: skip


class _NullRecorder:
    """The recorder of a run without tracing: every span is one shared no-op."""

    __slots__ = ()

    @property
    def enabled(self) -> bool:
        return False

    def span(self, name: str, *, cat: str, **args: Any) -> AbstractContextManager[None]:
        return _NOTHING

    def begin(self, name: str, *, cat: str, **args: Any) -> Callable[[], None]:
        return _no_op


def _no_op() -> None:
    return None


NULL = _NullRecorder()


def span_on(world: Any, name: str, *, cat: str, **args: Any) -> AbstractContextManager[None]:
    """``world.tracer.span(...)`` when the world has a recorder, else a no-op (``world``
    may be a stand-in without the attribute, as in doctests)."""
    rec = getattr(world, "tracer", None)
    return _NOTHING if rec is None else rec.span(name, cat=cat, **args)


def gather_parts(world: World, rec: Recorder) -> list[RankTrace] | None:
    """Every rank's ``export()`` on rank 0, in rank order (None on the others): one
    collective at the end of a run, so a launcher per node still writes one whole trace."""
    parts: list[Any] | None = [None] * world.world_size if world.rank == 0 else None
    dist.gather_object(rec.export(), parts, dst=0)
    return parts


def comm_span(world: World, kind: str) -> AbstractContextManager[None]:
    """``world.tracer.comm_step(kind)`` when tracing, else a no-op (also for a stand-in
    world without the attribute)."""
    rec = getattr(world, "tracer", None)
    return _NOTHING if rec is None else rec.comm_step(kind)


def _clock_sync(world: World, *, rounds: int) -> tuple[int, int, int]:
    """(offset to rank 0, half the best round trip, rank 0's clock at the end), in ns.

    Rank 0 answers ``rounds`` pings of each other rank in rank order with its clock."""
    buf = torch.zeros(1, dtype=torch.int64, device=world.device)  # nccl: a CUDA tensor
    best_rtt, offset = 0, 0
    if world.rank == 0:
        for peer in range(1, world.world_size):
            for _ in range(rounds):
                dist.recv(buf, peer)
                buf[0] = time.perf_counter_ns()
                dist.send(buf, peer)
    else:
        for _ in range(rounds):
            sent = time.perf_counter_ns()
            dist.send(buf, 0)
            dist.recv(buf, 0)
            back = time.perf_counter_ns()
            rtt = back - sent
            if best_rtt == 0 or rtt < best_rtt:
                best_rtt, offset = rtt, int(buf[0]) - (sent + back) // 2
    origin = torch.tensor([time.perf_counter_ns()], dtype=torch.int64, device=world.device)
    dist.broadcast(origin, 0)
    return offset, best_rtt // 2, int(origin[0])


def chrome_trace(
    parts: Sequence[RankTrace], *, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Every rank's events as trace-event JSON (``{"traceEvents": [...]}``): ``pid`` = rank,
    ``tid`` = thread (0 compute, 1 comm), ``ts``/``dur`` in microseconds on rank 0's clock
    since its ``start``; per rank and thread sorted by start (a parent before its children).
    ``otherData`` keeps each rank's clock offset and its uncertainty, and ``meta``."""
    events: list[dict[str, Any]] = []
    clocks = {}
    for part in sorted(parts, key=lambda p: p.rank):
        pid = part.rank
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"rank {pid}"}})  # fmt: skip
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})  # fmt: skip
        for tid, name in THREAD_NAMES.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": name}})  # fmt: skip
        shift = part.offset_ns - part.origin_ns
        ordered = sorted(part.events, key=lambda e: (e[2], e[3], -e[4]))
        for name, cat, tid, begin, end, args in ordered:
            event: dict[str, Any] = {
                "ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
                "ts": (begin + shift) / 1e3, "dur": (end - begin) / 1e3,
            }  # fmt: skip
            if args:
                event["args"] = args
            events.append(event)
        clocks[str(pid)] = {"offset_us": part.offset_ns / 1e3,
                            "uncertainty_us": part.uncertainty_ns / 1e3}  # fmt: skip
    other = {"clock": "rank 0's perf_counter since the trace start", "clocks": clocks}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {**other, **(meta or {})}}
