"""Stage I of ParDNN: slice the graph into K primary and many secondary clusters.

Each cluster is a path (or one node). The primaries are the K heaviest paths, each
found on what is left of the graph after removing the previous ones, with weighted
levels (``tl + bl``, compute plus communication) recomputed each time. The secondaries
reuse the last weighted levels: from the heaviest node left, walk to the heaviest
remaining successor until a dead end; repeat until every node is in a cluster.
Cost: (K + 1) level computations, O(K (V + E)), plus a sort, O(V log V).

A diamond ``a -> {b, c} -> d`` with a heavy ``b`` and two devices::

    primary 0: a b d      (the critical path)
    primary 1: c

>>> from hspmd.partition.graph import OpGraph
>>> g = OpGraph.build("diamond", "abcd", time_us=[1.0, 5.0, 2.0, 1.0],
...                   out_bytes=[0] * 4, residual_bytes=[0] * 4,
...                   edges=[(0, 1), (0, 2), (1, 3), (2, 3)])
>>> s = slice_graph(g, num_devices=2, edge_us=np.full(4, 25.0))
>>> [s.cluster(i).tolist() for i in range(s.num_clusters)], s.num_primary
([[0, 1, 3], [2]], 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hspmd.partition import native
from hspmd.partition.graph import OpGraph, longest_paths


@dataclass(frozen=True, eq=False)
class Slicing:
    """Clusters as paths: members of cluster ``c`` are ``members[ptr[c]:ptr[c+1]]``."""

    cluster_of: np.ndarray  # int64 [V]
    members: np.ndarray  # int64 [V], grouped by cluster, each in path order
    ptr: np.ndarray  # int64 [C + 1]
    num_primary: int  # clusters 0 .. num_primary-1 are the primaries, one per device
    top_level: np.ndarray  # float64 [V], top levels on the whole graph (expected starts)
    bottom_level: np.ndarray  # float64 [V], bottom levels on the whole graph (upward ranks)

    @property
    def num_clusters(self) -> int:
        return len(self.ptr) - 1

    def cluster(self, c: int) -> np.ndarray:
        return self.members[self.ptr[c] : self.ptr[c + 1]]

    def __str__(self) -> str:
        sizes = np.diff(self.ptr)
        return (
            f"{self.num_primary} primary clusters of {sizes[: self.num_primary].tolist()} "
            f"nodes, {self.num_clusters - self.num_primary} secondary"
        )


def slice_graph(graph: OpGraph, *, num_devices: int, edge_us: np.ndarray) -> Slicing:
    """Cut ``graph`` into ``num_devices`` primary paths and secondary paths."""
    num = graph.num_nodes
    alive = np.ones(num, dtype=bool)
    out_ptr: list[int] = [] if native.ENABLED else graph.out_ptr.tolist()
    dst: list[int] = [] if native.ENABLED else graph.dst.tolist()
    paths: list[list[int]] = []
    top, bottom = longest_paths(graph, node_w=graph.time_us, edge_w=edge_us)
    first_top, first_bottom = top, bottom
    for _ in range(num_devices):
        if not alive.any():
            break
        wlvl = _rounded(top + bottom)
        # a heaviest path starts at a source of what is left: the heaviest, then earliest
        candidates = np.flatnonzero(alive & (_alive_in_degree(graph, alive) == 0))
        best = candidates[np.lexsort((candidates, -wlvl[candidates]))[0]]
        if native.ENABLED:
            walked, _ = native.walk_kernel(
                np.array([best], dtype=np.int64), graph.out_ptr, graph.dst, alive.copy(), wlvl
            )
            path = walked.tolist()
        else:
            path = _walk(int(best), out_ptr, dst, alive.tolist(), wlvl.tolist())
        alive[path] = False
        paths.append(path)
        top, bottom = longest_paths(graph, node_w=graph.time_us, edge_w=edge_us, alive=alive)
    num_primary = len(paths)
    if native.ENABLED:  # the same walks, compiled
        wlvl = _rounded(top + bottom)
        left = np.flatnonzero(alive)
        order = left[np.lexsort((top[left], -wlvl[left]))]
        rest, rest_sizes = native.walk_kernel(
            order, graph.out_ptr, graph.dst, alive.copy(), np.ascontiguousarray(wlvl)
        )
        primary = np.fromiter((v for p in paths for v in p), dtype=np.int64)
        sizes = np.concatenate(([len(p) for p in paths], rest_sizes)).astype(np.int64)
        members = np.concatenate((primary, rest))
        return _slicing_of(members, sizes, num, num_primary, first_top, first_bottom)
    paths += _secondary_paths(alive, _rounded(top + bottom), top, out_ptr, dst)
    return _as_slicing(paths, num, num_primary, first_top, first_bottom)


def _rounded(wlvl: np.ndarray) -> np.ndarray:
    """Weighted levels with float noise removed, so that the nodes of one path tie."""
    scale = max(float(np.abs(wlvl).max(initial=0.0)), 1.0) * 1e-9
    return np.round(wlvl / scale) * scale


def _alive_in_degree(graph: OpGraph, alive: np.ndarray) -> np.ndarray:
    live = alive[graph.src] & alive[graph.dst]
    return np.bincount(graph.dst[live], minlength=graph.num_nodes)


def _walk(
    start: int, out_ptr: list[int], dst: list[int], alive: list[bool], wlvl: list[float]
) -> list[int]:
    """Follow the heaviest alive successor from ``start`` until a dead end."""
    path = [start]
    alive[start] = False
    v = start
    while True:
        best, best_w = -1, -1.0
        for e in range(out_ptr[v], out_ptr[v + 1]):
            u = dst[e]
            if alive[u] and wlvl[u] > best_w:
                best, best_w = u, wlvl[u]
        if best < 0:
            return path
        alive[best] = False
        path.append(best)
        v = best


def _secondary_paths(
    alive: np.ndarray, wlvl: np.ndarray, top: np.ndarray, out_ptr: list[int], dst: list[int]
) -> list[list[int]]:
    left = np.flatnonzero(alive)
    order = left[np.lexsort((top[left], -wlvl[left]))].tolist()
    alive_list = alive.tolist()
    wlvl_list = wlvl.tolist()
    paths = []
    for v in order:
        if alive_list[v]:
            paths.append(_walk(v, out_ptr, dst, alive_list, wlvl_list))
    return paths


def _as_slicing(
    paths: list[list[int]], num: int, num_primary: int, top: np.ndarray, bottom: np.ndarray
) -> Slicing:
    sizes = np.fromiter((len(p) for p in paths), dtype=np.int64, count=len(paths))
    members = np.fromiter((v for p in paths for v in p), dtype=np.int64, count=num)
    return _slicing_of(members, sizes, num, num_primary, top, bottom)


def _slicing_of(
    members: np.ndarray,
    sizes: np.ndarray,
    num: int,
    num_primary: int,
    top: np.ndarray,
    bottom: np.ndarray,
) -> Slicing:
    ptr = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=ptr[1:])
    cluster_of = np.empty(num, dtype=np.int64)
    cluster_of[members] = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    return Slicing(
        cluster_of=cluster_of,
        members=members,
        ptr=ptr,
        num_primary=num_primary,
        top_level=top,
        bottom_level=bottom,
    )
