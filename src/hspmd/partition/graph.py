"""The op-level computational graph that ParDNN partitions.

An :class:`OpGraph` is a DAG of ``V`` ops held as numpy arrays: per-op compute time,
output bytes and residual bytes (state that lives across steps, e.g. variables), and
``E`` edges as two index arrays ``src -> dst``. ``colocate[v]`` is ``-1`` or the
index of an op that ``v`` must share a device with (a reference op and its variable).

Derived data (CSR adjacency, a topological order, hop levels) is computed once, on
first use, with linear passes, and cached on the (immutable) graph.

>>> g = OpGraph.build("tiny", ("a", "b", "c"), time_us=[1.0, 2.0, 3.0],
...                   out_bytes=[8, 8, 8], residual_bytes=[0, 0, 0],
...                   edges=[(0, 1), (0, 2), (1, 2), (0, 1)])
>>> g.num_nodes, g.num_edges, g.topo_order.tolist(), g.level.tolist()
(3, 3, [0, 1, 2], [0, 1, 2])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress
from typing import Any

import numpy as np

from hspmd.errors import PartitionError
from hspmd.partition import native

IntArray = np.ndarray
FloatArray = np.ndarray


@dataclass(frozen=True, eq=False)
class OpGraph:
    """An immutable op graph; build it with :meth:`OpGraph.build`, which validates."""

    name: str
    names: tuple[str, ...]
    time_us: FloatArray  # float64 [V]
    out_bytes: IntArray  # int64 [V]
    residual_bytes: IntArray  # int64 [V]
    src: IntArray  # int64 [E], sorted by src (stable), no duplicates
    dst: IntArray  # int64 [E]
    colocate: IntArray  # int64 [V], -1 or the index of a node to share a device with
    # where the costs came from (informative; written to and read from the JSON "meta")
    meta: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"OpGraph({self.name!r}, nodes={self.num_nodes}, edges={self.num_edges})"

    @staticmethod
    def build(
        name: str,
        names: Sequence[str],
        *,
        time_us: Any,
        out_bytes: Any,
        residual_bytes: Any,
        edges: Any,
        colocate: Any = None,
        meta: dict[str, Any] | None = None,
    ) -> OpGraph:
        """Validate and freeze a graph (``meta``: informative, e.g. how costs were found).

        ``edges`` is an ``[E, 2]`` array-like of node indices, or of node names.
        Duplicate edges are merged; self loops, cycles, bad lengths and negative costs
        raise :class:`PartitionError` naming the problem.
        """
        names_t = tuple(str(n) for n in names)
        num = len(names_t)
        times = _vector(time_us, np.float64, "time_us", num)
        outs = _vector(out_bytes, np.int64, "out_bytes", num)
        residual = _vector(residual_bytes, np.int64, "residual_bytes", num)
        for label, arr in (("time_us", times), ("out_bytes", outs), ("residual_bytes", residual)):
            if num and (not np.all(np.isfinite(arr)) or arr.min() < 0):
                bad = int(np.flatnonzero(~np.isfinite(arr) | (arr < 0))[0])
                raise PartitionError(
                    f"graph {name!r}: {label}[{names_t[bad]!r}] = {arr[bad]} must be finite and >= 0"
                )
        if len(set(names_t)) != num:
            dup = next(n for i, n in enumerate(names_t) if n in names_t[:i])
            raise PartitionError(f"graph {name!r}: node name {dup!r} appears more than once")
        src, dst = _edge_arrays(name, names_t, edges)
        if colocate is None:
            coloc = np.full(num, -1, dtype=np.int64)
        else:
            coloc = _vector(colocate, np.int64, "colocate", num)
            if num and (coloc.min() < -1 or coloc.max() >= num):
                raise PartitionError(
                    f"graph {name!r}: colocate entries must be -1 or a node index < {num}"
                )
        graph = OpGraph(name, names_t, times, outs, residual, src, dst, coloc, dict(meta or {}))
        graph._check_acyclic()
        return graph

    # ---- sizes and lookups -------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    @property
    def num_edges(self) -> int:
        return int(self.src.shape[0])

    @cached_property
    def index(self) -> dict[str, int]:
        """Node name -> node index."""
        return {n: i for i, n in enumerate(self.names)}

    # ---- adjacency (CSR) ---------------------------------------------------------

    @cached_property
    def out_ptr(self) -> IntArray:
        """Successors of ``v`` are ``dst[out_ptr[v]:out_ptr[v+1]]`` (edges are sorted by src)."""
        return _pointers(self.src, self.num_nodes)

    @cached_property
    def in_edges(self) -> IntArray:
        """Edge ids sorted by (dst, src): the in-edges of ``v`` are
        ``in_edges[in_ptr[v]:in_ptr[v+1]]``."""
        return np.lexsort((self.src, self.dst)).astype(np.int64)

    @cached_property
    def in_ptr(self) -> IntArray:
        return _pointers(self.dst[self.in_edges], self.num_nodes)

    @cached_property
    def preds(self) -> IntArray:
        """Predecessors grouped by node, aligned with :attr:`in_ptr`."""
        return self.src[self.in_edges]

    @cached_property
    def in_degree(self) -> IntArray:
        return np.diff(self.in_ptr)

    @cached_property
    def out_degree(self) -> IntArray:
        return np.diff(self.out_ptr)

    # ---- orders and levels -------------------------------------------------------

    @cached_property
    def topo_order(self) -> IntArray:
        """Kahn's order: a FIFO queue seeded with the sources in index order."""
        order = _kahn_order(self)
        assert len(order) == self.num_nodes, "checked acyclic at build"
        return np.asarray(order, dtype=np.int64)

    @cached_property
    def topo_rank(self) -> IntArray:
        """Position of each node in :attr:`topo_order`."""
        rank = np.empty(self.num_nodes, dtype=np.int64)
        rank[self.topo_order] = np.arange(self.num_nodes, dtype=np.int64)
        return rank

    @cached_property
    def group_of(self) -> IntArray:
        """Colocation group of each node: the smallest index among the nodes that
        ``colocate`` links to it (directly or through others); its own index if none."""
        if not (self.colocate >= 0).any():
            return np.arange(self.num_nodes, dtype=np.int64)
        parent = list(range(self.num_nodes))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for v in np.flatnonzero(self.colocate >= 0).tolist():
            a, b = find(v), find(int(self.colocate[v]))
            if a != b:
                parent[max(a, b)] = min(a, b)
        return np.asarray([find(v) for v in range(self.num_nodes)], dtype=np.int64)

    @cached_property
    def edges_by_src_rank(self) -> IntArray:
        """Edge ids sorted by the topological rank of their source."""
        return np.argsort(self.topo_rank[self.src], kind="stable").astype(np.int64)

    @cached_property
    def edge_tuples(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Sources and destinations of :attr:`edges_by_src_rank` as tuples of ints, for
        the pure-Python passes of :func:`longest_paths` (built once: converting 450K
        edges costs about as much as one pass)."""
        order = self.edges_by_src_rank
        return tuple(self.src[order].tolist()), tuple(self.dst[order].tolist())

    @cached_property
    def level(self) -> IntArray:
        """Hop level: 0 for sources, else 1 + the largest level of a predecessor."""
        ones = np.ones(self.num_nodes)
        top, _ = longest_paths(self, node_w=ones, edge_w=np.zeros(self.num_edges))
        return top.astype(np.int64)

    def _check_acyclic(self) -> None:
        order = _kahn_order(self)
        if len(order) < self.num_nodes:
            seen = np.zeros(self.num_nodes, dtype=bool)
            seen[order] = True
            stuck = [self.names[i] for i in np.flatnonzero(~seen)[:3]]
            raise PartitionError(
                f"graph {self.name!r} has a cycle through {self.num_nodes - len(order)} "
                f"nodes, e.g. {stuck}; a partitioner needs a DAG (drop back edges)"
            )
        object.__setattr__(self, "topo_order", np.asarray(order, dtype=np.int64))


def longest_paths(
    graph: OpGraph,
    *,
    node_w: FloatArray,
    edge_w: FloatArray,
    alive: np.ndarray | None = None,
) -> tuple[FloatArray, FloatArray]:
    """Top and bottom levels of every node, in two flat passes over the edges.

    ``tl[v]``: the heaviest path from a source to ``v``, ``v`` excluded; ``bl[v]``: the
    heaviest path from ``v`` to a sink, ``v`` included; a path weighs its nodes'
    ``node_w`` plus its edges' ``edge_w``. With ``alive`` only the subgraph induced by
    the alive nodes counts (dead nodes get 0). ``tl + bl`` is the weighted level, equal
    to the critical path length on every critical node. O(V + E).
    """
    order = graph.edges_by_src_rank
    src, dst = graph.src[order], graph.dst[order]
    weights = np.where(alive, node_w, 0.0) if alive is not None else node_w
    forward = edge_w[order] + weights[dst]
    backward = edge_w[order] + weights[src]
    live = alive[src] & alive[dst] if alive is not None else None
    if live is not None:
        forward, backward = forward[live], backward[live]
    if native.ENABLED:  # the same two passes, compiled
        if live is not None:
            src, dst = src[live], dst[live]
        w64 = np.ascontiguousarray(weights, dtype=np.float64)
        finish_a, bottom_a = native.longest_paths_kernel(src, dst, forward, backward, w64)
        return finish_a - weights, bottom_a
    src_l, dst_l = graph.edge_tuples
    if live is not None:
        keep = live.tolist()
        src_l, dst_l = tuple(compress(src_l, keep)), tuple(compress(dst_l, keep))
    # forward: finish[t] = max(finish[t], finish[s] + edge + w[t]), s in topological order
    finish = weights.tolist()
    for s, t, c in zip(src_l, dst_l, forward.tolist(), strict=True):
        x = finish[s] + c
        if x > finish[t]:
            finish[t] = x
    # backward: bl[s] = max(bl[s], w[s] + edge + bl[t]), s in reverse topological order
    bottom = weights.tolist()
    steps = backward.tolist()
    for s, t, c in zip(reversed(src_l), reversed(dst_l), reversed(steps), strict=True):
        x = bottom[t] + c
        if x > bottom[s]:
            bottom[s] = x
    return np.asarray(finish) - weights, np.asarray(bottom)


def _kahn_order(graph: OpGraph) -> list[int] | IntArray:
    if native.ENABLED:  # the same queue, compiled
        in_degree = graph.in_degree.astype(np.int64)
        return native.kahn_kernel(graph.out_ptr, graph.dst, in_degree)
    return _kahn(graph.num_nodes, graph.out_ptr.tolist(), graph.dst.tolist(), graph.in_degree)


def _kahn(num: int, out_ptr: list[int], dst: list[int], in_degree: IntArray) -> list[int]:
    remaining = in_degree.tolist()
    order = [v for v in range(num) if remaining[v] == 0]
    head = 0
    while head < len(order):
        v = order[head]
        head += 1
        for e in range(out_ptr[v], out_ptr[v + 1]):
            u = dst[e]
            remaining[u] -= 1
            if remaining[u] == 0:
                order.append(u)
    return order


def _pointers(sorted_keys: IntArray, num: int) -> IntArray:
    counts = np.bincount(sorted_keys, minlength=num) if len(sorted_keys) else np.zeros(num, int)
    ptr = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def _vector(values: Any, dtype: type, label: str, num: int) -> np.ndarray:
    arr: np.ndarray = (
        np.asarray(values, dtype=dtype).reshape(-1) if len(values) else np.zeros(0, dtype)
    )
    if arr.shape[0] != num:
        raise PartitionError(f"{label} has {arr.shape[0]} entries but the graph has {num} nodes")
    arr = arr.copy()
    arr.setflags(write=False)
    return arr


def _named_pairs(edges: Any) -> bool:
    """True if every edge is a pair of names (str), as the JSON and dot readers give."""
    return all(
        isinstance(e, (tuple, list)) and len(e) == 2 and type(e[0]) is str and type(e[1]) is str
        for e in edges
    )


def _edge_arrays(name: str, names: tuple[str, ...], edges: Any) -> tuple[IntArray, IntArray]:
    num = len(names)
    if len(edges) and not isinstance(edges, np.ndarray) and _named_pairs(edges):
        index = {n: i for i, n in enumerate(names)}  # names -> ids without a string array
        try:
            edges = [(index[str(a)], index[str(b)]) for a, b in edges]
        except KeyError as missing:
            raise PartitionError(f"graph {name!r}: edge endpoint {missing} is not a node") from None
    raw = np.asarray(edges) if len(edges) else np.zeros((0, 2), dtype=np.int64)
    if raw.ndim != 2 or raw.shape[1] != 2:
        raise PartitionError(f"graph {name!r}: edges must be pairs, got shape {raw.shape}")
    if raw.dtype.kind in "USO":
        index = {n: i for i, n in enumerate(names)}
        try:
            raw = np.array([[index[str(a)], index[str(b)]] for a, b in raw], dtype=np.int64)
        except KeyError as missing:
            raise PartitionError(f"graph {name!r}: edge endpoint {missing} is not a node") from None
        raw = raw.reshape(-1, 2)
    raw = raw.astype(np.int64)
    if len(raw) and (raw.min() < 0 or raw.max() >= num):
        raise PartitionError(f"graph {name!r}: edge endpoints must be node indices in [0, {num})")
    loops = np.flatnonzero(raw[:, 0] == raw[:, 1])
    if len(loops):
        raise PartitionError(
            f"graph {name!r}: self loop on {names[int(raw[loops[0], 0])]!r}; drop it"
        )
    # merge duplicates keeping the first, then sort by source keeping the input order
    # of each source's successors (it decides ties in the topological order)
    _, first = np.unique(raw[:, 0] * num + raw[:, 1], return_index=True)
    raw = raw[np.sort(first)]
    raw = raw[np.argsort(raw[:, 0], kind="stable")]
    src = np.ascontiguousarray(raw[:, 0])
    dst = np.ascontiguousarray(raw[:, 1])
    src.setflags(write=False)
    dst.setflags(write=False)
    return src, dst
