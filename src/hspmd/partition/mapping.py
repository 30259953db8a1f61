"""Stage II of ParDNN: map the secondary clusters onto the K primaries (devices).

1. Initial merging: a secondary cluster whose communication its span cannot hide
   (``comm(sc) > potential(sc)``, the work of other ops expected to start inside its
   span) joins the device it communicates with most.
2. Level-Aware Load Balancing (LALB): the rest, heaviest first, go to the device that
   minimizes (its work expected inside the cluster's span) + (communication with the
   ops already on other devices); ties go to the device it talks to most. The work per
   device over expected start times is kept in one Fenwick tree per device, so the
   span query and each node's update cost O(log V).

A cluster's span runs from the expected finish of the last parent of its first op to
the expected start of the first child of its last op (expected = top levels).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import neg

import numpy as np

from hspmd.partition import native
from hspmd.partition.graph import OpGraph
from hspmd.partition.slicing import Slicing


class Fenwick:
    """Prefix sums over positions ``0..n-1`` with point updates, both O(log n).

    >>> f = Fenwick(np.array([1.0, 2.0, 3.0, 4.0]))
    >>> f.range_sum(1, 3), f.add(2, 10.0), f.range_sum(0, 4)
    (5.0, None, 20.0)
    """

    def __init__(self, values: np.ndarray) -> None:
        n = len(values)
        prefix = np.concatenate(([0.0], np.cumsum(values, dtype=np.float64)))
        index = np.arange(1, n + 1)
        # node i covers (i - lowbit(i), i]
        self.tree = [0.0] + (prefix[index] - prefix[index - (index & -index)]).tolist()
        self.size = n

    def add(self, pos: int, value: float) -> None:
        tree, i, n = self.tree, pos + 1, self.size
        while i <= n:
            tree[i] += value
            i += i & -i

    def prefix(self, end: int) -> float:
        """Sum of positions ``0..end-1``."""
        tree, i, total = self.tree, end, 0.0
        while i > 0:
            total += tree[i]
            i &= i - 1
        return total

    def range_sum(self, lo: int, hi: int) -> float:
        """Sum of positions ``lo..hi-1``: both prefixes walked until they meet, so a short
        range costs a few steps."""
        tree, total = self.tree, 0.0
        while hi > lo:
            total += tree[hi]
            hi &= hi - 1
        while lo > hi:
            total -= tree[lo]
            lo &= lo - 1
        return total


class DeviceWork:
    """Work per device over positions ``0..n-1``: one Fenwick tree per device, and a
    range query that walks the tree indices once and sums every device's tree along
    them (C-level ``sum``/``map``), so K devices cost about one walk.

    >>> dw = DeviceWork(np.array([1.0, 2.0, 3.0, 4.0]), np.array([0, 1, 0, 1]), k=2)
    >>> dw.range_sums(1, 4), dw.add(1, 2, 10.0), dw.range_sums(0, 4)
    ([3.0, 6.0], None, [4.0, 16.0])
    """

    def __init__(self, values: np.ndarray, device: np.ndarray, *, k: int) -> None:
        self.trees = [Fenwick(np.where(device == d, values, 0.0)).tree for d in range(k)]
        self.size = len(values)

    def add(self, device: int, pos: int, value: float) -> None:
        tree, i, n = self.trees[device], pos + 1, self.size
        while i <= n:
            tree[i] += value
            i += i & -i

    def range_sums(self, lo: int, hi: int) -> list[float]:
        """Per device, the sum of positions ``lo..hi-1`` (same walk as
        :meth:`Fenwick.range_sum`, same order of additions)."""
        if hi <= lo:  # an empty span (a cluster expected to start and end at once)
            return [0.0] * len(self.trees)
        plus, minus = [], []
        while hi > lo:
            plus.append(hi)
            hi &= hi - 1
        while lo > hi:
            minus.append(lo)
            lo &= lo - 1
        return [
            sum(map(neg, map(t.__getitem__, minus)), sum(map(t.__getitem__, plus)))
            for t in self.trees
        ]


def cluster_spans(
    graph: OpGraph, slicing: Slicing, *, top: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Expected (start, end) time of each cluster's span."""
    w = graph.time_us
    first = slicing.members[slicing.ptr[:-1]]
    last = slicing.members[slicing.ptr[1:] - 1]
    parent_finish = np.full(graph.num_nodes, -np.inf)
    np.maximum.at(parent_finish, graph.dst, top[graph.src] + w[graph.src])
    child_start = np.full(graph.num_nodes, np.inf)
    np.minimum.at(child_start, graph.src, top[graph.dst])
    start = np.where(np.isfinite(parent_finish[first]), parent_finish[first], top[first])
    end = np.where(np.isfinite(child_start[last]), child_start[last], top[last] + w[last])
    return start, np.maximum(end, start)


Boundary = tuple[list[int], list[int], list[float]]


def boundary_lists(graph: OpGraph, slicing: Slicing, *, edge_us: np.ndarray) -> Boundary:
    """Per cluster, its edges to other clusters as (ptr, other node, cost) in CSR."""
    cl = slicing.cluster_of
    cross = cl[graph.src] != cl[graph.dst]
    owner = np.concatenate((cl[graph.src][cross], cl[graph.dst][cross]))
    other = np.concatenate((graph.dst[cross], graph.src[cross]))
    cost = np.concatenate((edge_us[cross], edge_us[cross]))
    order = np.argsort(owner, kind="stable")
    ptr = np.zeros(slicing.num_clusters + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=slicing.num_clusters), out=ptr[1:])
    return ptr.tolist(), other[order].tolist(), cost[order].tolist()


def map_clusters(
    graph: OpGraph,
    slicing: Slicing,
    *,
    num_devices: int,
    edge_us: np.ndarray,
    top: np.ndarray,
    boundary: Boundary | None = None,
) -> np.ndarray:
    """Device of every node after initial merging and LALB (``boundary``: the result of
    :func:`boundary_lists`, if the caller has it)."""
    place = np.full(graph.num_nodes, -1, dtype=np.int64)
    for c in range(slicing.num_primary):
        place[slicing.cluster(c)] = c
    boundary = boundary or boundary_lists(graph, slicing, edge_us=edge_us)
    spans = _Spans.of(graph, slicing, top=top, boundary=boundary)
    if native.ENABLED:  # the same two loops, compiled
        return _map_compiled(graph, slicing, place, spans, boundary, k=num_devices)
    return _map_python(graph, slicing, place, spans, boundary, k=num_devices)


@dataclass(frozen=True, eq=False)
class _Spans:
    """Nodes in order of top level, and each cluster's span as a range of that order."""

    by_time: np.ndarray  # node ids by top level (stable)
    pos: np.ndarray  # each node's position in ``by_time``
    lo: np.ndarray  # per cluster, its span is by_time[lo:hi]
    hi: np.ndarray
    cluster_work: np.ndarray
    hide: np.ndarray  # per cluster: its communication exceeds the other work in its span

    @staticmethod
    def of(graph: OpGraph, slicing: Slicing, *, top: np.ndarray, boundary: Boundary) -> _Spans:
        w = graph.time_us
        start, end = cluster_spans(graph, slicing, top=top)
        by_time = np.argsort(top, kind="stable")
        sorted_top = top[by_time]
        pos = np.empty(graph.num_nodes, dtype=np.int64)
        pos[by_time] = np.arange(graph.num_nodes)
        lo = np.searchsorted(sorted_top, start, side="left")
        hi = np.searchsorted(sorted_top, end, side="left")
        cluster_work = np.bincount(slicing.cluster_of, weights=w, minlength=slicing.num_clusters)
        cum_work = np.concatenate(([0.0], np.cumsum(w[by_time])))
        potential = cum_work[hi] - cum_work[lo] - cluster_work
        bptr, _, bcost = boundary
        comm_total = np.add.reduceat(np.asarray(bcost + [0.0]), np.asarray(bptr[:-1]))
        comm_total[np.diff(bptr) == 0] = 0.0
        return _Spans(by_time, pos, lo, hi, cluster_work, comm_total > potential)


def _map_compiled(
    graph: OpGraph,
    slicing: Slicing,
    place: np.ndarray,
    spans: _Spans,
    boundary: Boundary,
    *,
    k: int,
) -> np.ndarray:
    """:func:`map_clusters`' initial merge and LALB by the kernels (``place`` updated)."""
    w = graph.time_us
    b_ptr, b_other, b_cost = (np.asarray(b) for b in boundary)
    members = slicing.members.astype(np.int64)
    cptr = slicing.ptr.astype(np.int64)
    merged = native.initial_merge_kernel(
        slicing.num_primary, members, cptr, place, b_ptr, b_other, b_cost, spans.hide, k
    )
    merged = merged[np.argsort(-spans.cluster_work[merged], kind="stable")]
    trees = native.fenwick_trees(w[spans.by_time], place[spans.by_time], k)
    native.lalb_kernel(
        merged, members, cptr, place, trees, b_ptr, b_other, b_cost, spans.lo, spans.hi,
        spans.pos, w,
    )  # fmt: skip
    return place


def _map_python(
    graph: OpGraph,
    slicing: Slicing,
    place: np.ndarray,
    spans: _Spans,
    boundary: Boundary,
    *,
    k: int,
) -> np.ndarray:
    """:func:`map_clusters`' initial merge and LALB in Python (the kernels' reference)."""
    w = graph.time_us
    bptr, bother, bcost = boundary
    place_l = place.tolist()
    deferred = _initial_merge(slicing, place_l, bptr, bother, bcost, hide=spans.hide.tolist(), k=k)
    place = np.asarray(place_l, dtype=np.int64)
    work = DeviceWork(w[spans.by_time], place[spans.by_time], k=k)
    deferred.sort(key=lambda c: -spans.cluster_work[c])
    _lalb(
        slicing,
        deferred,
        place_l,
        work,
        bptr,
        bother,
        bcost,
        lo=spans.lo.tolist(),
        hi=spans.hi.tolist(),
        pos=spans.pos.tolist(),
        w=w.tolist(),
        k=k,
    )
    return np.asarray(place_l, dtype=np.int64)


def _comm_to(
    c: int, place: list[int], bptr: list[int], bother: list[int], bcost: list[float], k: int
) -> list[float]:
    acc = [0.0] * k
    for i in range(bptr[c], bptr[c + 1]):
        d = place[bother[i]]
        if d >= 0:
            acc[d] += bcost[i]
    return acc


def _initial_merge(
    slicing: Slicing,
    place: list[int],
    bptr: list[int],
    bother: list[int],
    bcost: list[float],
    *,
    hide: list[bool],
    k: int,
) -> list[int]:
    """Merge the clusters that cannot hide their communication; return the others."""
    deferred = []
    members, ptr = slicing.members.tolist(), slicing.ptr.tolist()
    for c in range(slicing.num_primary, slicing.num_clusters):
        if hide[c]:
            acc = _comm_to(c, place, bptr, bother, bcost, k)
            best = max(range(k), key=acc.__getitem__)
            if acc[best] > 0.0:
                for v in members[ptr[c] : ptr[c + 1]]:
                    place[v] = best
                continue
        deferred.append(c)
    return deferred


def _lalb(
    slicing: Slicing,
    clusters: list[int],
    place: list[int],
    work: DeviceWork,
    bptr: list[int],
    bother: list[int],
    bcost: list[float],
    *,
    lo: list[int],
    hi: list[int],
    pos: list[int],
    w: list[float],
    k: int,
) -> None:
    members, ptr = slicing.members.tolist(), slicing.ptr.tolist()
    devices = range(k)
    for c in clusters:
        acc = _comm_to(c, place, bptr, bother, bcost, k)
        total = sum(acc)
        span = work.range_sums(lo[c], hi[c])
        best = min(devices, key=lambda d: (span[d] + total - acc[d], -acc[d]))
        tree, n = work.trees[best], work.size
        for v in members[ptr[c] : ptr[c + 1]]:
            place[v] = best
            i, x = pos[v] + 1, w[v]  # work.add, inlined (the hottest loop)
            while i <= n:
                tree[i] += x
                i += i & -i
