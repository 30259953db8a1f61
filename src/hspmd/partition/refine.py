"""Stage III of ParDNN: refine a mapping.

* :func:`remap_clusters` (coarse, per secondary cluster): once every op has a device,
  re-decide each secondary cluster with the LALB rule, now seeing all its neighbours,
  and move it if that lowers (work in its span) + (communication it incurs).
* :func:`switch_critical_nodes` (fine, per node; the paper's node switching): compute
  the critical path of the placed graph (edges cost only when they cross devices); for
  each crossing edge on it, move the endpoint whose move shortens the longest path
  through it. Repeated up to K times, O(K (V + E)).
* :func:`improve_by_emulation` (our addition, see docs/decisions.md): a hill climb on
  the emulated makespan. It traces the critical chain of the emulated schedule (what
  each op on it waited for: an input transfer or its busy device) and tries moving the
  ops at the waits; a move is kept only if the emulated makespan drops.
"""

from __future__ import annotations

import numpy as np

from hspmd.partition import native
from hspmd.partition.emulate import CommModel, schedule
from hspmd.partition.graph import OpGraph, longest_paths
from hspmd.partition.mapping import Boundary, DeviceWork, boundary_lists, cluster_spans
from hspmd.partition.slicing import Slicing


def move_group(graph: OpGraph, place: np.ndarray, node: int, device: int) -> np.ndarray:
    """A copy of ``place`` with ``node`` and its colocation group on ``device``."""
    new = place.copy()
    group = graph.group_of
    if graph.colocate.max(initial=-1) < 0:
        new[node] = device
    else:
        new[group == group[node]] = device
    return new


def remap_clusters(
    graph: OpGraph,
    slicing: Slicing,
    place: np.ndarray,
    *,
    num_devices: int,
    edge_us: np.ndarray,
    top: np.ndarray,
    boundary: Boundary | None = None,
) -> np.ndarray:
    """Move whole secondary clusters where the LALB cost, with full information, drops
    (``boundary``: the result of :func:`boundary_lists`, if the caller has it)."""
    w = graph.time_us
    start, end = cluster_spans(graph, slicing, top=top)
    order_by_time = np.argsort(top, kind="stable")
    sorted_top = top[order_by_time]
    pos = np.empty(graph.num_nodes, dtype=np.int64)
    pos[order_by_time] = np.arange(graph.num_nodes)
    lo = np.searchsorted(sorted_top, start, side="left").tolist()
    hi = np.searchsorted(sorted_top, end, side="left").tolist()
    bptr, bother, bcost = boundary or boundary_lists(graph, slicing, edge_us=edge_us)
    work = np.bincount(slicing.cluster_of, weights=w, minlength=slicing.num_clusters)
    order = np.argsort(-work[slicing.num_primary :], kind="stable") + slicing.num_primary
    if native.ENABLED:  # the same loop, compiled
        out = place.astype(np.int64)  # a copy
        native.remap_kernel(
            order.astype(np.int64), slicing.members.astype(np.int64),
            slicing.ptr.astype(np.int64), out, graph.group_of == np.arange(graph.num_nodes),
            work, native.fenwick_trees(w[order_by_time], out[order_by_time], num_devices),
            np.asarray(bptr), np.asarray(bother), np.asarray(bcost),
            np.asarray(lo), np.asarray(hi), pos, w,
        )  # fmt: skip
        return out
    trees = DeviceWork(w[order_by_time], place[order_by_time], k=num_devices)
    members, ptr = slicing.members.tolist(), slicing.ptr.tolist()
    place_l, pos_l, w_l = place.tolist(), pos.tolist(), w.tolist()
    group_free = (graph.group_of == np.arange(graph.num_nodes)).tolist()
    for c in order:
        nodes = members[ptr[c] : ptr[c + 1]]
        here = place_l[nodes[0]]
        if any(place_l[v] != here or not group_free[v] for v in nodes):
            continue
        acc = [0.0] * num_devices
        for i in range(bptr[c], bptr[c + 1]):
            acc[place_l[bother[i]]] += bcost[i]
        own = [0.0] * num_devices
        own[here] = float(work[c])  # the cluster's own work is in its device's tree
        total = sum(acc)
        span = trees.range_sums(lo[c], hi[c])
        cost = [span[d] - own[d] + total - acc[d] for d in range(num_devices)]
        best = min(range(num_devices), key=lambda d: (cost[d], d != here))
        if best != here and cost[best] < cost[here] - 1e-9:
            for v in nodes:
                place_l[v] = best
                trees.add(here, pos_l[v], -w_l[v])
                trees.add(best, pos_l[v], w_l[v])
    return np.asarray(place_l, dtype=np.int64)


def switch_critical_nodes(
    graph: OpGraph, place: np.ndarray, *, edge_us: np.ndarray, rounds: int
) -> np.ndarray:
    """The paper's node switching on the critical path of the placed graph."""
    place = place.copy()
    out_ptr, dst = graph.out_ptr.tolist(), graph.dst.tolist()
    in_ptr, in_edges = graph.in_ptr.tolist(), graph.in_edges.tolist()
    src = graph.src.tolist()
    w = graph.time_us.tolist()
    cost = edge_us.tolist()
    alone = (np.bincount(graph.group_of, minlength=graph.num_nodes)[graph.group_of] == 1).tolist()
    for _ in range(rounds):
        crossing = np.where(place[graph.src] != place[graph.dst], edge_us, 0.0)
        top, bottom = longest_paths(graph, node_w=graph.time_us, edge_w=crossing)
        top_l, bottom_l, place_l = top.tolist(), bottom.tolist(), place.tolist()
        path = _critical_path(top + bottom, top, out_ptr, dst)
        moved = False
        for a, b in zip(path, path[1:], strict=False):
            if place_l[a] == place_l[b]:
                continue
            for node, device in ((b, place_l[a]), (a, place_l[b])):
                if not alone[node]:
                    continue
                old = top_l[node] + bottom_l[node]
                ctx = (in_ptr, in_edges, src, out_ptr, dst, w, cost, top_l, bottom_l, place_l)
                if _through(node, device, *ctx) < old - 1e-9:
                    place_l[node] = device
                    moved = True
                    break
        place = np.asarray(place_l, dtype=np.int64)
        if not moved:
            break
    return place


def _critical_path(
    wlvl: np.ndarray, top: np.ndarray, out_ptr: list[int], dst: list[int]
) -> list[int]:
    v = int(np.lexsort((top, -wlvl))[0])
    wl = wlvl.tolist()
    path = [v]
    while out_ptr[v] < out_ptr[v + 1]:
        v = max((dst[e] for e in range(out_ptr[v], out_ptr[v + 1])), key=wl.__getitem__)
        path.append(v)
    return path


def _through(
    node: int,
    device: int,
    in_ptr: list[int],
    in_edges: list[int],
    src: list[int],
    out_ptr: list[int],
    dst: list[int],
    w: list[float],
    cost: list[float],
    top: list[float],
    bottom: list[float],
    place: list[int],
) -> float:
    """Longest path through ``node`` if it were on ``device`` (neighbours unchanged)."""
    before = 0.0
    for i in range(in_ptr[node], in_ptr[node + 1]):
        e = in_edges[i]
        p = src[e]
        before = max(before, top[p] + w[p] + (cost[e] if place[p] != device else 0.0))
    after = 0.0
    for e in range(out_ptr[node], out_ptr[node + 1]):
        s = dst[e]
        after = max(after, bottom[s] + (cost[e] if place[s] != device else 0.0))
    return before + w[node] + after


def critical_chain(
    graph: OpGraph, place: np.ndarray, start: np.ndarray, finish: np.ndarray, *, delay: np.ndarray
) -> list[tuple[int, int, bool]]:
    """Walk back from the last op: ``(waited_for, op, was_transfer)`` per step.

    ``waited_for`` is the input whose arrival set the op's start, or else the op that
    ran before it on its device (``was_transfer`` False).
    """
    by_device = np.lexsort((start, place))
    prev_on_device = np.full(graph.num_nodes, -1, dtype=np.int64)
    same = place[by_device[1:]] == place[by_device[:-1]]
    prev_on_device[by_device[1:][same]] = by_device[:-1][same]
    in_ptr, in_edges, src = graph.in_ptr, graph.in_edges, graph.src
    chain = []
    v = int(np.argmax(finish))
    tol = 1e-9 * max(1.0, float(finish.max(initial=0.0)))
    while start[v] > tol:
        preds = src[in_edges[in_ptr[v] : in_ptr[v + 1]]]
        arrive = finish[preds] + np.where(place[preds] != place[v], delay[preds], 0.0)
        if preds.size and arrive.max() >= start[v] - tol:
            p = int(preds[int(np.argmax(arrive))])
            chain.append((p, v, bool(place[p] != place[v])))
        else:
            p = int(prev_on_device[v])
            if p < 0:
                break
            chain.append((p, v, False))
        v = p
    return chain


def improve_by_emulation(
    graph: OpGraph,
    place: np.ndarray,
    *,
    num_devices: int,
    comm: CommModel,
    max_trials: int,
) -> np.ndarray:
    """First-improvement hill climb on the emulated makespan (see the module docstring)."""
    delay = comm.cost_us(graph.out_bytes)
    start, finish = schedule(graph, place, comm=comm)
    best = float(finish.max(initial=0.0))
    trials = 0
    tried: set[tuple[int, int]] = set()
    while trials < max_trials:
        improved = False
        for node, device in _candidates(graph, place, start, finish, delay, num_devices):
            if trials >= max_trials:
                break
            key = (node, device)
            if key in tried:
                continue
            tried.add(key)
            trials += 1
            trial = move_group(graph, place, node, device)
            t_start, t_finish = schedule(graph, trial, comm=comm)
            makespan = float(t_finish.max(initial=0.0))
            if makespan < best - 1e-9:
                place, start, finish, best = trial, t_start, t_finish, makespan
                tried.clear()
                improved = True
                break
        if not improved:
            break
    return place


def _candidates(
    graph: OpGraph,
    place: np.ndarray,
    start: np.ndarray,
    finish: np.ndarray,
    delay: np.ndarray,
    num_devices: int,
) -> list[tuple[int, int]]:
    """Moves suggested by the critical chain, latest waits first."""
    out: list[tuple[int, int]] = []
    for waited, op, transfer in critical_chain(graph, place, start, finish, delay=delay):
        if transfer:
            out.append((op, int(place[waited])))
            out.append((waited, int(place[op])))
        else:
            # the device was busy with ``waited``: move it (or else the op) elsewhere
            out += [(waited, d) for d in range(num_devices) if d != place[waited]]
            out += [(op, d) for d in range(num_devices) if d != place[op]]
    return out


def relieve_busiest(
    graph: OpGraph,
    slicing: Slicing,
    place: np.ndarray,
    *,
    num_devices: int,
    edge_us: np.ndarray,
    rounds: int = 2,
    boundary: Boundary | None = None,
) -> np.ndarray:
    """Move secondary clusters off the busiest devices while their slack hides the new
    transfers (see docs/decisions.md, "load relief").

    The longest path of the placed graph (crossing edges cost) is ``L``. A cluster on
    device ``h`` moves to a less loaded ``t`` if the heaviest path through it with the
    new crossings stays within ``L`` and the move lowers ``max(W[h], W[t])`` (``W``: work
    per device). Neighbours of a moved cluster wait for the next round (their levels are
    stale). One level computation per round: O(rounds (V + E)). ``boundary``: the
    result of :func:`boundary_lists`, if the caller has it.
    """
    place = place.copy()
    relief = _Relief(graph, slicing, edge_us=edge_us, boundary=boundary)
    for _ in range(rounds):
        crossing = np.where(place[graph.src] != place[graph.dst], edge_us, 0.0)
        top, bottom = longest_paths(graph, node_w=graph.time_us, edge_w=crossing)
        limit = float((top + bottom).max(initial=0.0)) + 1e-9
        if native.ENABLED:  # the same round, compiled
            moved = relief.round_compiled(place, top, bottom, limit, num_devices)
        else:
            place, moved = relief.round_python(place, top, bottom, limit, num_devices)
        if not moved:
            break
    return place


class _Relief:
    """What every round of :func:`relieve_busiest` reads: the secondary clusters by
    decreasing work, their members and boundaries, and which ops lead their group."""

    def __init__(
        self, graph: OpGraph, slicing: Slicing, *, edge_us: np.ndarray, boundary: Boundary | None
    ) -> None:
        self.w = graph.time_us
        self.slicing = slicing
        self.bptr, self.bother, self.bcost = boundary or boundary_lists(
            graph, slicing, edge_us=edge_us
        )
        self.in_side = _entry_sides(graph, slicing, edge_us=edge_us)
        self.members, self.ptr = slicing.members.tolist(), slicing.ptr.tolist()
        work = np.bincount(slicing.cluster_of, weights=self.w, minlength=slicing.num_clusters)
        self.work = work.tolist()
        self.group_free = (graph.group_of == np.arange(graph.num_nodes)).tolist()
        # clusters 1.. by decreasing work, ties by index (a stable sort, as sorted() was)
        self.order = (np.argsort(-np.asarray(self.work[1:]), kind="stable") + 1).tolist()
        self._arrays: tuple[np.ndarray, ...] | None = None

    def round_compiled(
        self, place: np.ndarray, top: np.ndarray, bottom: np.ndarray, limit: float, k: int
    ) -> int:
        """One round by the kernel (``place`` updated in place); the clusters moved."""
        load = np.bincount(place, weights=self.w, minlength=k)
        o, m, p, g, wk, cl, b_ptr, b_other, b_cost, side = self._kernel_arrays()
        return int(
            native.relieve_round_kernel(
                o, m, p, place, g, wk, load, cl, b_ptr, b_other, b_cost, side,
                top, bottom, self.w, limit,
            )
        )  # fmt: skip

    def _kernel_arrays(self) -> tuple[np.ndarray, ...]:
        if self._arrays is None:
            s = self.slicing
            self._arrays = (
                np.asarray(self.order, dtype=np.int64), s.members.astype(np.int64),
                s.ptr.astype(np.int64), np.asarray(self.group_free, dtype=bool),
                np.asarray(self.work), s.cluster_of.astype(np.int64), np.asarray(self.bptr),
                np.asarray(self.bother), np.asarray(self.bcost),
                np.asarray(self.in_side, dtype=bool),
            )  # fmt: skip
        return self._arrays

    def round_python(
        self, place: np.ndarray, top: np.ndarray, bottom: np.ndarray, limit: float, k: int
    ) -> tuple[np.ndarray, int]:
        """One round in Python: the new placement and the number of clusters moved."""
        load = np.bincount(place, weights=self.w, minlength=k).tolist()
        place_l, top_l, bot_l = place.tolist(), top.tolist(), bottom.tolist()
        frozen = [False] * self.slicing.num_clusters
        cl = self.slicing.cluster_of.tolist()
        moved = 0
        for c in self.order:
            nodes = self.members[self.ptr[c] : self.ptr[c + 1]]
            h = place_l[nodes[0]]
            if frozen[c] or any(place_l[v] != h or not self.group_free[v] for v in nodes):
                continue
            t = self._target(c, h, load, place_l, top_l, bot_l, limit)
            if t is None:
                continue
            for v in nodes:
                place_l[v] = t
            load[h] -= self.work[c]
            load[t] += self.work[c]
            for i in range(self.bptr[c], self.bptr[c + 1]):
                frozen[cl[self.bother[i]]] = True
            moved += 1
        return np.asarray(place_l, dtype=np.int64), moved

    def _target(
        self,
        c: int,
        h: int,
        load: list[float],
        place_l: list[int],
        top_l: list[float],
        bot_l: list[float],
        limit: float,
    ) -> int | None:
        """The least loaded device that takes cluster ``c`` off ``h`` with its new
        crossings hidden, or None (the loads are tried in order until one stops helping)."""
        work, w, bother, bcost, in_side = (
            self.work[c],
            self.w,
            self.bother,
            self.bcost,
            self.in_side,
        )
        targets = sorted((d for d in range(len(load)) if d != h), key=load.__getitem__)
        for t in targets:
            if max(load[h] - work, load[t] + work) >= max(load[h], load[t]):
                return None
            enter, leave = 0.0, 0.0
            for i in range(self.bptr[c], self.bptr[c + 1]):
                u = bother[i]
                cost = bcost[i] if place_l[u] != t else 0.0
                if in_side[i]:
                    enter = max(enter, top_l[u] + w[u] + cost)
                else:
                    leave = max(leave, cost + bot_l[u])
            # a path no longer than the busiest device's new work is hidden by it
            if enter + work + leave <= max(limit, load[h] - work, load[t] + work):
                return t
        return None


def _entry_sides(graph: OpGraph, slicing: Slicing, *, edge_us: np.ndarray) -> list[bool]:
    """Aligned with :func:`boundary_lists`: True where the other node is a predecessor."""
    cl = slicing.cluster_of
    cross = cl[graph.src] != cl[graph.dst]
    owner = np.concatenate((cl[graph.src][cross], cl[graph.dst][cross]))
    side = np.concatenate((np.zeros(int(cross.sum()), bool), np.ones(int(cross.sum()), bool)))
    return side[np.argsort(owner, kind="stable")].tolist()
