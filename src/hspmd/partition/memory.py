"""Step 2 of ParDNN: meet per-device memory caps.

Tracking: the emulated schedule gives every output copy a lifetime on a device
(:func:`hspmd.partition.emulate.buffers`); with the residual bytes (always live) that
gives each device's peak and the time of the peak.

Repair, while some device ``d`` peaks above its cap by ``O`` bytes at time ``t``:
every op ``n`` on ``d`` gets a memory potential (the bytes moving it would free at
``t``: its residual bytes, the live copies it is the last consumer of and has not
started yet, its own output if it runs at ``t``) and a move cost (its compute time
plus its communication with ops on ``d``). Ops leave ``d`` in order of move cost /
potential from a min-heap, with a second heap keyed by move cost alone for the ops
whose potential covers the whole overflow (the paper's two heaps), each to the
device that talks to it most among those with room, until the potentials add up
to ``O``. Moved ops are not moved again. Then emulate again; stop when the caps hold,
or raise :class:`PartitionError` saying how much memory is missing where.
"""

from __future__ import annotations

import heapq

import numpy as np

from hspmd.errors import PartitionError
from hspmd.partition.emulate import CommModel, buffers, schedule
from hspmd.partition.graph import OpGraph


def gib(num_bytes: float) -> str:
    """A byte count for people: ``gib(3 * 2**29) == '1.50 GiB'``, ``gib(2048) == '2.00 KiB'``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


def check_residual_fits(graph: OpGraph, caps: np.ndarray) -> None:
    """Raise if the caps are provably too small, naming the missing bytes.

    Three lower bounds that hold for every placement: all residual state fits in the
    sum of the caps; a colocation group's residual state fits in one device; and an op,
    when it starts, holds its output and every input on its device at once (the
    emulator frees an input only when its last consumer there starts, after the
    consumer's output is allocated), next to its group's residual state.
    """
    total = int(graph.residual_bytes.sum())
    if total > int(caps.sum()):
        raise PartitionError(
            f"total residual {gib(total)} exceeds the sum of caps {gib(caps.sum())} by "
            f"{gib(total - caps.sum())}; raise --memory or add devices"
        )
    largest = int(caps.max())
    per_group = np.bincount(graph.group_of, weights=graph.residual_bytes)
    worst = int(np.argmax(per_group)) if per_group.size else 0
    if per_group.size and per_group[worst] > largest:
        raise PartitionError(
            f"op {graph.names[worst]!r} and the ops colocated with it hold "
            f"{gib(per_group[worst])} of residual state, more than the largest cap "
            f"{gib(largest)} by {gib(per_group[worst] - largest)}; raise --memory"
        )
    output, inputs = op_working_set(graph)
    need = output + inputs + per_group[graph.group_of] if per_group.size else output + inputs
    v = int(np.argmax(need)) if need.size else 0
    if need.size and need[v] > largest:
        raise PartitionError(
            f"op {graph.names[v]!r} needs {gib(need[v])} at once on its device (output "
            f"{gib(output[v])}, inputs {gib(inputs[v])}, residual {gib(need[v] - output[v] - inputs[v])}), "
            f"more than the largest cap {gib(largest)} by {gib(need[v] - largest)}; raise --memory"
        )


def op_working_set(graph: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """Per op: bytes of its own output and of its inputs, all live when it starts.

    Residual producers are left out (their state is counted where they live).
    """
    output = np.where(graph.residual_bytes > 0, 0, graph.out_bytes).astype(np.float64)
    inputs = np.bincount(graph.dst, weights=output[graph.src], minlength=graph.num_nodes)
    return output, inputs


def profile(
    graph: OpGraph, place: np.ndarray, *, start: np.ndarray, finish: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Peak bytes and the time of the peak, per device."""
    buf = buffers(graph, place, start=start, finish=finish)
    times = np.concatenate((buf.alloc_us, buf.free_us))
    devices = np.concatenate((buf.device, buf.device))
    deltas = np.concatenate((buf.size, -buf.size))
    order = np.lexsort((deltas < 0, times, devices))
    devices, times, running = devices[order], times[order], np.cumsum(deltas[order])
    base = np.bincount(place, weights=graph.residual_bytes, minlength=k).astype(np.int64)
    peak, when = base.copy(), np.zeros(k)
    for d in range(k):
        lo, hi = np.searchsorted(devices, [d, d + 1])
        if hi > lo:
            offset = running[lo - 1] if lo else 0
            i = lo + int(np.argmax(running[lo:hi]))
            peak[d] = base[d] + max(int(running[i] - offset), 0)
            when[d] = times[i]
    return peak, when


def usage_at(
    graph: OpGraph, place: np.ndarray, *, start: np.ndarray, finish: np.ndarray, at: float, k: int
) -> np.ndarray:
    """Bytes in use on each device at time ``at``."""
    buf = buffers(graph, place, start=start, finish=finish)
    live = (buf.alloc_us <= at) & (buf.free_us >= at)
    used = np.bincount(buf.device[live], weights=buf.size[live], minlength=k)
    return used + np.bincount(place, weights=graph.residual_bytes, minlength=k)


def repair_memory(
    graph: OpGraph,
    place: np.ndarray,
    *,
    caps: np.ndarray,
    comm: CommModel,
    max_rounds: int = 200,
) -> np.ndarray:
    """Move ops off overflowing devices until every peak is within its cap."""
    check_residual_fits(graph, caps)
    k = len(caps)
    place = place.copy()
    tried = np.zeros(graph.num_nodes, dtype=bool)
    edge_us = comm.cost_us(graph.out_bytes[graph.src])
    start, finish = schedule(graph, place, comm=comm)
    peak, when = profile(graph, place, start=start, finish=finish, k=k)
    batch: np.ndarray | None = None
    for _ in range(max_rounds):
        over = peak - caps
        if (over <= 0).all():
            return place
        for d in np.argsort(-over)[: int((over > 0).sum())].tolist():
            at = float(when[d])
            pot = potentials(graph, place, start=start, finish=finish, device=d, at=at)
            cost = move_costs(graph, place, edge_us=edge_us, device=d)
            # room on the other devices at the time of the overflow
            room = caps - usage_at(graph, place, start=start, finish=finish, at=at, k=k)
            room[d] = -np.inf
            trial = place.copy()
            need = int(over[d])
            batch = _relieve(graph, trial, tried, pot=pot, cost=cost, room=room, need=need)
            if batch is not None:
                break
        if batch is None:
            break
        t_start, t_finish = schedule(graph, trial, comm=comm)
        t_peak, t_when = profile(graph, trial, start=t_start, finish=t_finish, k=k)
        # keep a batch only if the total overflow shrinks; never retry its ops
        tried[batch] = True
        if np.maximum(t_peak - caps, 0).sum() < np.maximum(over, 0).sum():
            place, start, finish, peak, when = trial, t_start, t_finish, t_peak, t_when
            tried[:] = False
            tried[batch] = True
    over = peak - caps
    if (over <= 0).all():
        return place
    parts = [
        f"device {d} needs {gib(over[d])} more than its cap {gib(caps[d])} "
        f"(peak {gib(peak[d])} at t={when[d]:,.0f} us)"
        for d in np.flatnonzero(over > 0)
    ]
    raise PartitionError(
        "could not meet the memory caps: " + "; ".join(parts) + "; raise --memory or add devices"
    )


def potentials(
    graph: OpGraph,
    place: np.ndarray,
    *,
    start: np.ndarray,
    finish: np.ndarray,
    device: int,
    at: float,
) -> np.ndarray:
    """Bytes freed on ``device`` at time ``at`` by moving each op away (0 if not on it)."""
    buf = buffers(graph, place, start=start, finish=finish)
    live = (buf.device == device) & (buf.alloc_us <= at) & (buf.free_us >= at)
    pot = np.zeros(graph.num_nodes)
    # live copies whose release waits for a consumer that has not started yet
    waiting = live & (buf.last_consumer >= 0)
    waiting &= start[np.maximum(buf.last_consumer, 0)] >= at
    np.add.at(pot, buf.last_consumer[waiting], buf.size[waiting])
    running = (start <= at) & (finish >= at)
    pot += np.where(running, buf.size[: graph.num_nodes], 0)
    pot += graph.residual_bytes
    pot[place != device] = 0
    # an op moves with its colocation group: the group's potential counts
    group_pot = np.bincount(graph.group_of, weights=pot, minlength=graph.num_nodes)
    return group_pot[graph.group_of]


def move_costs(
    graph: OpGraph, place: np.ndarray, *, edge_us: np.ndarray, device: int
) -> np.ndarray:
    """Compute time plus communication with neighbours on ``device`` (paper, Eqn 4)."""
    cost = graph.time_us.copy()
    local = (place[graph.src] == device) & (place[graph.dst] == device)
    np.add.at(cost, graph.src[local], edge_us[local])
    np.add.at(cost, graph.dst[local], edge_us[local])
    return cost


def _relieve(
    graph: OpGraph,
    place: np.ndarray,
    tried: np.ndarray,
    *,
    pot: np.ndarray,
    cost: np.ndarray,
    room: np.ndarray,
    need: int,
) -> np.ndarray | None:
    """Greedy min-knapsack from two heaps; moves ops in ``place``; returns the moved ops
    (None if none could move)."""
    group = graph.group_of
    cands = np.flatnonzero((pot > 0) & ~tried & (group == np.arange(graph.num_nodes)))
    ratio_heap = [(cost[v] / pot[v], int(v)) for v in cands]
    big_heap = [(cost[v], int(v)) for v in cands if pot[v] >= need]
    heapq.heapify(ratio_heap)
    heapq.heapify(big_heap)
    taken = np.zeros(graph.num_nodes, dtype=bool)
    freed, batch = 0.0, []
    while freed < need and (ratio_heap or big_heap):
        v = _pop_cheaper(ratio_heap, big_heap, cost, taken)
        if v < 0:
            break
        members = np.flatnonzero(group == v) if (group == v).sum() > 1 else np.array([v])
        taken[members] = True
        fits = np.flatnonzero(room >= pot[v])
        if fits.size == 0:
            continue
        talk = _comm_with(graph, members, place, k=len(room))[fits]
        target = int(fits[np.lexsort((-room[fits], -talk))[0]])
        place[members] = target
        room[target] -= pot[v]
        freed += pot[v]
        batch.append(members)
    return np.concatenate(batch) if batch else None


def _pop_cheaper(
    ratio_heap: list[tuple[float, int]],
    big_heap: list[tuple[float, int]],
    cost: np.ndarray,
    moved: np.ndarray,
) -> int:
    """Pop the top of both heaps, keep the one with the lower move cost, return the other."""
    while ratio_heap and moved[ratio_heap[0][1]]:
        heapq.heappop(ratio_heap)
    while big_heap and moved[big_heap[0][1]]:
        heapq.heappop(big_heap)
    a = ratio_heap[0][1] if ratio_heap else -1
    b = big_heap[0][1] if big_heap else -1
    if a < 0 and b < 0:
        return -1
    if b < 0 or (a >= 0 and cost[a] <= cost[b]):
        heapq.heappop(ratio_heap)
        return a
    heapq.heappop(big_heap)
    return b


def _comm_with(graph: OpGraph, members: np.ndarray, place: np.ndarray, *, k: int) -> np.ndarray:
    """Bytes exchanged between ``members`` and each device."""
    is_member = np.zeros(graph.num_nodes, dtype=bool)
    is_member[members] = True
    out = is_member[graph.src] & ~is_member[graph.dst]
    inc = is_member[graph.dst] & ~is_member[graph.src]
    total = np.bincount(
        place[graph.dst[out]], weights=graph.out_bytes[graph.src[out]], minlength=k
    ).astype(np.float64)
    total += np.bincount(
        place[graph.src[inc]], weights=graph.out_bytes[graph.src[inc]], minlength=k
    )
    return total
