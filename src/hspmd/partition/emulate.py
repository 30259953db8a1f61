"""Emulation of a FIFO dataflow scheduler: start/finish times, memory peaks, traffic.

The model (the one behind the figures in ``data/pardnn/README.md``):

* each device runs one op at a time, never preempted;
* an op is ready when all its inputs have arrived; an input made on another device
  arrives ``latency_us + out_bytes / bytes_per_us`` after its producer finished, and is
  sent once per (producer, destination device); links never contend;
* an idle device starts, among its ready ops, the one with the earliest ready time,
  ties broken by topological index (:attr:`OpGraph.topo_rank`);
* memory on a device: the residual bytes of its ops, always; an op's output from the
  op's start until its last local consumer starts (until it finishes if it has no local
  consumer; never for a residual op, whose output is its residual state); a copy on each
  other consuming device from the producer's finish until the last consumer there
  starts. Allocations come before releases at equal times.

Two ops, one device each, one edge of 140 000 bytes (1 µs of transfer + 25 µs latency):

>>> from hspmd.partition.graph import OpGraph
>>> g = OpGraph.build("two", ("a", "b"), time_us=[10.0, 5.0], out_bytes=[140000, 8],
...                   residual_bytes=[0, 0], edges=[(0, 1)])
>>> em = emulate(g, np.array([0, 1]))
>>> em.makespan_us, em.start_us.tolist(), em.comm_bytes, em.peak_bytes.tolist()
(41.0, [0.0, 36.0], 140000, [140000, 140008])
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from hspmd.cost.link import transfer_time
from hspmd.errors import PartitionError
from hspmd.partition import native
from hspmd.partition.graph import OpGraph


@dataclass(frozen=True, slots=True)
class CommModel:
    """Point-to-point cost: ``latency_us + bytes / bytes_per_us`` (140 000 B/µs = 140 GB/s),
    priced by the link model every cost in hspmd uses (``hspmd.cost.link``)."""

    latency_us: float = 25.0
    bytes_per_us: float = 140000.0

    def __post_init__(self) -> None:
        if self.latency_us < 0 or self.bytes_per_us <= 0:
            raise PartitionError(
                f"CommModel(latency_us={self.latency_us}, bytes_per_us={self.bytes_per_us}): "
                "latency must be >= 0 and bandwidth > 0"
            )

    def __str__(self) -> str:
        return f"{self.latency_us:g} us + bytes / {self.bytes_per_us:g} B/us"

    def cost_us(self, num_bytes: np.ndarray) -> np.ndarray:
        """Transfer time of each output, in µs."""
        num_bytes = np.asarray(num_bytes, dtype=np.float64)
        return transfer_time(num_bytes, per_byte=1.0 / self.bytes_per_us, latency=self.latency_us)


@dataclass(frozen=True, eq=False)
class Emulation:
    """Result of :func:`emulate`: times per op, peak bytes per device, bytes sent."""

    makespan_us: float
    start_us: np.ndarray  # float64 [V]
    finish_us: np.ndarray  # float64 [V]
    peak_bytes: np.ndarray  # int64 [K]
    comm_bytes: int

    def __str__(self) -> str:
        peaks = ", ".join(f"{p / 2**30:.3f}" for p in self.peak_bytes)
        return (
            f"makespan {self.makespan_us:,.1f} us, peak GiB [{peaks}], "
            f"comm {self.comm_bytes / 2**30:.3f} GiB"
        )


def check_placement(graph: OpGraph, placement: np.ndarray) -> np.ndarray:
    """Return ``placement`` as an int64 array [V] of device ids >= 0, or raise."""
    place = np.asarray(placement)
    if place.shape != (graph.num_nodes,) or (place.size and place.dtype.kind not in "iu"):
        raise PartitionError(
            f"placement must be an int array of {graph.num_nodes} device ids, "
            f"got shape {place.shape} dtype {place.dtype}"
        )
    place = place.astype(np.int64)
    if place.size and place.min() < 0:
        bad = int(np.argmin(place))
        raise PartitionError(f"op {graph.names[bad]!r} is on device {place[bad]}; ids start at 0")
    return place


def emulate(graph: OpGraph, placement: np.ndarray, *, comm: CommModel = CommModel()) -> Emulation:
    """Emulate one step of ``graph`` run with ``placement`` (device id per op)."""
    place = check_placement(graph, placement)
    start, finish = schedule(graph, place, comm=comm)
    return emulation_of(graph, place, start=start, finish=finish)


def emulation_of(
    graph: OpGraph,
    place: np.ndarray,
    *,
    start: np.ndarray,
    finish: np.ndarray,
    k: int | None = None,
) -> Emulation:
    """The :class:`Emulation` of a schedule already computed (``k``: at least this many
    devices in ``peak_bytes``)."""
    num_devices = max(int(place.max()) + 1 if place.size else 1, k or 1)
    sent = _sent_pairs(graph, place, num_devices)
    comm_bytes = int(graph.out_bytes[sent // num_devices].sum()) if sent.size else 0
    peak = memory_peaks(graph, place, start=start, finish=finish, num_devices=num_devices)
    return Emulation(
        makespan_us=float(finish.max(initial=0.0)),
        start_us=start,
        finish_us=finish,
        peak_bytes=peak,
        comm_bytes=comm_bytes,
    )


def schedule(
    graph: OpGraph, place: np.ndarray, *, comm: CommModel = CommModel()
) -> tuple[np.ndarray, np.ndarray]:
    """Start and finish time of every op, by an event-driven FIFO list schedule.

    O((V + E) log V): one heap of events (finishes before device checks at equal
    times, so every op whose ready time is ``<= t`` is known when a device picks at
    ``t``) and one ready heap per device keyed by (ready time, topological index).
    """
    if native.ENABLED:  # the same event loop, compiled
        k = int(place.max()) + 1 if place.size else 1
        return native.schedule_kernel(
            np.ascontiguousarray(place, dtype=np.int64), graph.time_us,
            comm.cost_us(graph.out_bytes).astype(np.float64), graph.topo_rank,
            graph.out_ptr, graph.dst, graph.in_degree, k,
        )  # fmt: skip
    return _schedule_python(graph, place, comm=comm)


def _schedule_python(
    graph: OpGraph, place: np.ndarray, *, comm: CommModel
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`schedule`'s event loop in Python (the reference for the compiled kernel).

    Events are (time, kind, payload): kind 0 = op ``payload`` finished, 1 = device
    ``payload`` may pick its next ready op. One function, locals only: it is the
    emulator's hot loop without numba.
    """
    num = graph.num_nodes
    dev, dur, rank = place.tolist(), graph.time_us.tolist(), graph.topo_rank.tolist()
    delay = comm.cost_us(graph.out_bytes).tolist()
    out_ptr, dst, remaining = graph.out_ptr.tolist(), graph.dst.tolist(), graph.in_degree.tolist()
    ready, start, finish = [0.0] * num, [0.0] * num, [0.0] * num
    num_devices = max(dev, default=0) + 1
    queues: list[list[tuple[float, int, int]]] = [[] for _ in range(num_devices)]
    busy = [False] * num_devices
    for v in range(num):
        if remaining[v] == 0:
            heapq.heappush(queues[dev[v]], (0.0, rank[v], v))
    events = [(0.0, 1, d) for d in range(num_devices)]
    heapq.heapify(events)
    push, pop = heapq.heappush, heapq.heappop
    while events:
        now, kind, item = pop(events)
        if kind == 0:  # op ``item`` finished: free its device, send its output
            d = dev[item]
            busy[d] = False
            push(events, (now, 1, d))
            arrive = now + delay[item]
            for e in range(out_ptr[item], out_ptr[item + 1]):
                u = dst[e]
                t = now if dev[u] == d else arrive
                if t > ready[u]:
                    ready[u] = t
                remaining[u] -= 1
                if remaining[u] == 0:
                    push(queues[dev[u]], (ready[u], rank[u], u))
                    push(events, (ready[u], 1, dev[u]))
            continue
        queue = queues[item]
        if busy[item] or not queue or queue[0][0] > now:
            continue
        _, _, v = pop(queue)
        start[v] = now
        finish[v] = now + dur[v]
        busy[item] = True
        push(events, (finish[v], 0, v))
    return np.asarray(start, dtype=np.float64), np.asarray(finish, dtype=np.float64)


def _sent_pairs(graph: OpGraph, place: np.ndarray, num_devices: int) -> np.ndarray:
    """Unique ``producer * K + destination device`` keys of cross-device transfers."""
    cross = place[graph.src] != place[graph.dst]
    return np.unique(graph.src[cross] * num_devices + place[graph.dst[cross]])


def memory_peaks(
    graph: OpGraph,
    place: np.ndarray,
    *,
    start: np.ndarray,
    finish: np.ndarray,
    num_devices: int | None = None,
) -> np.ndarray:
    """Peak bytes per device over the emulated step (see the module docstring)."""
    times, devices, deltas = memory_events(graph, place, start=start, finish=finish)
    k = num_devices if num_devices is not None else (int(place.max()) + 1 if place.size else 1)
    base = np.bincount(place, weights=graph.residual_bytes, minlength=k).astype(np.int64)
    peak = base.copy()
    if times.size:
        # sort by (device, time, allocation before release): equal-time events overlap
        order = np.lexsort((deltas < 0, times, devices))
        dev_sorted = devices[order]
        running = np.cumsum(deltas[order])
        bounds = np.flatnonzero(np.diff(dev_sorted)) + 1
        starts = np.concatenate(([0], bounds))
        offsets = np.concatenate(([0], running[bounds - 1]))
        maxima = np.maximum.reduceat(running, starts) - offsets
        peak[dev_sorted[starts]] += np.maximum(maxima, 0)
    return peak


@dataclass(frozen=True, eq=False)
class Buffers:
    """Every output copy held on a device: ``size`` bytes from ``alloc_us`` to ``free_us``.

    ``last_consumer`` is the op whose start frees it (-1 if none: freed when the
    producer finishes). Local copies come first, one per op, in node order.
    """

    producer: np.ndarray
    device: np.ndarray
    size: np.ndarray
    alloc_us: np.ndarray
    free_us: np.ndarray
    last_consumer: np.ndarray


def buffers(graph: OpGraph, place: np.ndarray, *, start: np.ndarray, finish: np.ndarray) -> Buffers:
    """The output copies of an emulated step (see the module docstring)."""
    k = int(place.max()) + 1 if place.size else 1
    src, dst = graph.src, graph.dst
    size = graph.out_bytes
    # a residual op's output is its residual state, already counted as always live
    local_size = np.where(graph.residual_bytes > 0, 0, size)
    # last consumer per (producer, consumer device)
    keys = src * k + place[dst]
    order = np.lexsort((start[dst], keys))
    keys_sorted = keys[order]
    last = np.flatnonzero(np.r_[keys_sorted[1:] != keys_sorted[:-1], True])
    pair = keys_sorted[last]
    consumer = dst[order][last]
    producer = pair // k
    consumer_dev = pair % k
    local = consumer_dev == place[producer]
    # outputs without a local consumer are held while their op runs
    free_local = finish.copy()
    free_local[producer[local]] = start[consumer[local]]
    last_local = np.full(graph.num_nodes, -1, dtype=np.int64)
    last_local[producer[local]] = consumer[local]
    remote = producer[~local]
    return Buffers(
        producer=np.concatenate((np.arange(graph.num_nodes), remote)),
        device=np.concatenate((place, consumer_dev[~local])),
        size=np.concatenate((local_size, size[remote])),
        alloc_us=np.concatenate((start, finish[remote])),
        free_us=np.concatenate((free_local, start[consumer[~local]])),
        last_consumer=np.concatenate((last_local, consumer[~local])),
    )


def memory_events(
    graph: OpGraph,
    place: np.ndarray,
    *,
    start: np.ndarray,
    finish: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(time, device, +/- bytes) of every output allocation and release."""
    buf = buffers(graph, place, start=start, finish=finish)
    times = np.concatenate((buf.alloc_us, buf.free_us))
    devices = np.concatenate((buf.device, buf.device))
    deltas = np.concatenate((buf.size, -buf.size))
    return times, devices, deltas
