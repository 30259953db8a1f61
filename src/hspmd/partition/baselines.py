"""Baseline placements to judge ParDNN against; each returns a device id per op.

=============  ==============================================================
single_device  every op on device 0 (the makespan of one device)
round_robin    op ``i`` of the topological order on device ``i mod K`` (the
               paper's RR; :attr:`OpGraph.topo_order` is Kahn's FIFO order)
metis          METIS k-way cut of the undirected graph: node weight = time,
               edge weight = bytes (through pymetis)
heft           HEFT-style list scheduler: ops by decreasing upward rank, each
               on the device where it finishes first (same comm model)
=============  ==============================================================

Every baseline honours ``graph.colocate``: an op shares the device of its group.

>>> from hspmd.partition.graph import OpGraph
>>> g = OpGraph.build("chain", ("a", "b", "c", "d"), time_us=[1.0] * 4,
...                   out_bytes=[8] * 4, residual_bytes=[0] * 4,
...                   edges=[(0, 1), (1, 2), (2, 3)])
>>> round_robin(g, num_devices=2).tolist(), heft(g, num_devices=2).tolist()
([0, 1, 0, 1], [0, 0, 0, 0])
"""

from __future__ import annotations

import heapq

import numpy as np

from hspmd.errors import PartitionError
from hspmd.partition.eft import arrivals
from hspmd.partition.emulate import CommModel
from hspmd.partition.graph import OpGraph

_DEFAULT_COMM = CommModel()


def single_device(graph: OpGraph) -> np.ndarray:
    """Every op on device 0."""
    return np.zeros(graph.num_nodes, dtype=np.int64)


def round_robin(graph: OpGraph, *, num_devices: int) -> np.ndarray:
    """Deal the ops of the topological order over the devices like cards."""
    _check_devices(num_devices)
    place = np.empty(graph.num_nodes, dtype=np.int64)
    place[graph.topo_order] = np.arange(graph.num_nodes, dtype=np.int64) % num_devices
    return apply_colocation(graph, place)


def metis(graph: OpGraph, *, num_devices: int, seed: int = 0) -> np.ndarray:
    """A balanced min-cut of the undirected graph (time = node weight, bytes = edge weight)."""
    import pymetis

    _check_devices(num_devices)
    if num_devices == 1 or graph.num_nodes <= num_devices:
        return apply_colocation(graph, np.arange(graph.num_nodes, dtype=np.int64) % num_devices)
    xadj, adjncy, eweights = _undirected_csr(graph)
    vweights = np.maximum(np.rint(graph.time_us), 1).astype(np.int64)
    vweights = np.minimum(vweights, 2**31 // (graph.num_nodes + 1))
    options = pymetis.Options(seed=seed)
    _, parts = pymetis.part_graph(
        num_devices,
        pymetis.CSRAdjacency(adj_starts=xadj, adjacent=adjncy),
        vweights=vweights,
        eweights=eweights,
        options=options,
    )
    return apply_colocation(graph, np.asarray(parts, dtype=np.int64))


def _undirected_csr(graph: OpGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric CSR of the graph; a pair joined both ways gets the summed weight."""
    num = graph.num_nodes
    weight = graph.out_bytes[graph.src]
    a = np.concatenate((graph.src, graph.dst))
    b = np.concatenate((graph.dst, graph.src))
    w = np.concatenate((weight, weight))
    keys, inverse = np.unique(a * num + b, return_inverse=True)
    summed = np.bincount(inverse, weights=w)
    # METIS wants positive int32 weights: bytes in KiB, at least 1, capped
    eweights = np.clip(np.rint(summed / 1024.0), 1, 2**31 // (len(keys) + 1)).astype(np.int64)
    rows = keys // num
    xadj = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=num), out=xadj[1:])
    return xadj, keys % num, eweights


def upward_rank(graph: OpGraph, *, comm: CommModel = _DEFAULT_COMM) -> np.ndarray:
    """Longest path from each op to a sink, counting op times and every edge's transfer."""
    rank = graph.time_us.tolist()
    out_ptr = graph.out_ptr.tolist()
    dst = graph.dst.tolist()
    cost = comm.cost_us(graph.out_bytes).tolist()
    for v in reversed(graph.topo_order.tolist()):
        best = 0.0
        for e in range(out_ptr[v], out_ptr[v + 1]):
            tail = rank[dst[e]]
            if tail > best:
                best = tail
        if out_ptr[v + 1] > out_ptr[v]:
            best += cost[v]
        rank[v] += best
    return np.asarray(rank, dtype=np.float64)


def heft(graph: OpGraph, *, num_devices: int, comm: CommModel = _DEFAULT_COMM) -> np.ndarray:
    """List scheduling: ready ops by upward rank, each on its earliest-finish device.

    Without insertion into idle gaps (a device's next op starts after its last one),
    which is what a FIFO runtime does too. O((V + E) K + V log V).
    """
    _check_devices(num_devices)
    num = graph.num_nodes
    prio = upward_rank(graph, comm=comm).tolist()
    group = colocation_groups(graph).tolist()
    group_dev = [-1] * num
    out_ptr, dst = graph.out_ptr.tolist(), graph.dst.tolist()
    in_ptr, preds = graph.in_ptr.tolist(), graph.preds.tolist()
    dur = graph.time_us.tolist()
    delay = comm.cost_us(graph.out_bytes).tolist()
    remaining = graph.in_degree.tolist()
    place = [0] * num
    finish = [0.0] * num
    free = [0.0] * num_devices
    ready = [(-prio[v], v) for v in range(num) if remaining[v] == 0]
    heapq.heapify(ready)
    devices = range(num_devices)
    while ready:
        _, v = heapq.heappop(ready)
        arrive = arrivals(v, in_ptr, preds, place, finish, delay, num_devices)
        forced = group_dev[group[v]]
        if forced >= 0:
            best = forced
        else:
            best = min(devices, key=lambda d: (max(arrive[d], free[d]), d))
            group_dev[group[v]] = best
        place[v] = best
        finish[v] = max(arrive[best], free[best]) + dur[v]
        free[best] = finish[v]
        for e in range(out_ptr[v], out_ptr[v + 1]):
            u = dst[e]
            remaining[u] -= 1
            if remaining[u] == 0:
                heapq.heappush(ready, (-prio[u], u))
    return np.asarray(place, dtype=np.int64)


def colocation_groups(graph: OpGraph) -> np.ndarray:
    """Group id per op: ops linked by ``colocate`` (transitively) share one id."""
    parent = np.arange(graph.num_nodes, dtype=np.int64)
    linked = np.flatnonzero(graph.colocate >= 0)
    if not linked.size:
        return parent
    find_parent = parent.tolist()

    def find(x: int) -> int:
        while find_parent[x] != x:
            find_parent[x] = find_parent[find_parent[x]]
            x = find_parent[x]
        return x

    for v in linked.tolist():
        a, b = find(v), find(int(graph.colocate[v]))
        if a != b:
            find_parent[max(a, b)] = min(a, b)
    return np.asarray([find(v) for v in range(graph.num_nodes)], dtype=np.int64)


def apply_colocation(graph: OpGraph, place: np.ndarray) -> np.ndarray:
    """Move every op of a colocation group to the device of the group's lowest index."""
    if not (graph.colocate >= 0).any():
        return place
    group = colocation_groups(graph)
    return place[group]


def _check_devices(num_devices: int) -> None:
    if num_devices < 1:
        raise PartitionError(f"{num_devices=} must be at least 1")
