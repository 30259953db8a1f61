"""Step 2 of ParDNN: move ops off devices that peak above their caps.

Each round starts from an emulated schedule (:func:`hspmd.partition.emulate.buffers`
gives every output copy its device and lifetime) and plans a whole batch of moves on
*estimated* memory curves, then emulates once to check it:

* a buffer belongs to its last consumer (the op whose start frees it; the producer if
  it has none): moving an op moves the buffers it owns and its residual bytes with it;
* while some device ``d`` peaks above its cap on the estimated curves, the ops on ``d``
  that own bytes live at that peak leave, cheapest per freed byte first, from two
  heaps (by cost / freed bytes, and by cost alone for ops that free the whole
  overflow: the paper's two heaps), until the overflow at that peak is covered; each to
  the device with room where it costs least; the curves are updated and the next peak
  is taken;
* the cost of moving ``v`` to ``t``: how far the longest path through ``v`` (placed
  graph, crossing edges cost) would pass the critical path, plus a small share of the
  transfers the move adds and of its compute time. A move into an op's slack costs
  almost nothing. Once ``v`` moves, its neighbours on ``d`` are re-priced for ``t``
  (their edges to ``v`` no longer cross), so chains of neighbours (a layer's forward
  ops and their gradients) tend to move together as one chunk.

The batch is kept if the emulated total overflow shrinks; the ops of the last kept
batch, and of every batch dropped since, do not move again until another is kept. A device whose peak finds no move is
left for the round while the others go on. Rounds stop when the caps hold (or raise
:class:`PartitionError` saying how much memory is missing where). Usually one to three
rounds, each one schedule.
"""

from __future__ import annotations

import heapq

import numpy as np

from hspmd.errors import PartitionError
from hspmd.partition.emulate import Buffers, CommModel, buffers, schedule
from hspmd.partition.graph import OpGraph, longest_paths
from hspmd.partition.memory import check_residual_fits, gib

# weights of the secondary terms of a move's cost (the first is the lengthening, in us)
_COMM_SHARE = 0.3
_WORK_SHARE = 0.3
# graphs up to this V + E also try the op-by-op variant (one peak per emulation)
_SMALL_GRAPH = 125_000


def repair_memory(
    graph: OpGraph,
    place: np.ndarray,
    *,
    caps: np.ndarray,
    comm: CommModel,
    max_rounds: int = 30,
) -> np.ndarray:
    """Move ops off overflowing devices until every peak is within its cap.

    First with room on a target counted against its whole-step peak (no move can make
    a new peak there); if that cannot meet the caps, with room at the time of the peak
    being relieved (tight caps, every device near its cap at some time). On graphs with
    V + E up to 125K also op by op (one peak per emulation, room at its time); the
    fastest placement that meets the caps is returned.
    """
    found: list[np.ndarray] = []
    errors: list[PartitionError] = []
    # (room at the peak's time only?, peaks per round, rounds): the batch with whole-step
    # room, else with room at the peak's time; the op-by-op variant (one peak per
    # emulation, as the paper's loop) too where emulations are cheap
    variants: list[tuple[bool, int | None, int]] = [(False, None, max_rounds)]
    variants.append((True, None, max_rounds))
    if graph.num_nodes + graph.num_edges <= _SMALL_GRAPH:
        variants.append((True, 1, 10 * max_rounds))
    for n, (local, peaks, rounds) in enumerate(variants):
        if n == 1 and found:
            continue  # the whole-step batch worked: no need for the looser one
        try:
            found.append(
                _repair(
                    graph, place, caps=caps, comm=comm, max_rounds=rounds, local=local, peaks=peaks
                )
            )
        except PartitionError as exc:
            errors.append(exc)
    if not found:
        raise errors[0]
    if len(found) == 1:
        return found[0]
    spans = [float(schedule(graph, p, comm=comm)[1].max(initial=0.0)) for p in found]
    return found[int(np.argmin(spans))]


def _repair(
    graph: OpGraph,
    place: np.ndarray,
    *,
    caps: np.ndarray,
    comm: CommModel,
    max_rounds: int,
    local: bool,
    peaks: int | None,
) -> np.ndarray:
    check_residual_fits(graph, caps)
    k = len(caps)
    place = place.copy()
    moved = np.zeros(graph.num_nodes, dtype=bool)
    delay = comm.cost_us(graph.out_bytes)
    start, finish = schedule(graph, place, comm=comm)
    curves = _Curves(graph, place, start=start, finish=finish, k=k)
    for _ in range(max_rounds):
        over = curves.peak - caps
        if (over <= 0).all():
            return place
        trial = _plan(
            graph, place, moved, curves=curves, caps=caps, delay=delay, local=local, peaks=peaks
        )
        batch = trial != place
        if not batch.any():
            break
        t_start, t_finish = schedule(graph, trial, comm=comm)
        t_curves = _Curves(graph, trial, start=t_start, finish=t_finish, k=k)
        moved |= batch
        if np.maximum(t_curves.peak - caps, 0).sum() < np.maximum(over, 0).sum():
            place, curves = trial, t_curves
            moved = batch  # ops of earlier kept batches may move again, from the new state
    over = curves.peak - caps
    if (over <= 0).all():
        return place
    parts = [
        f"device {d} needs {gib(over[d])} more than its cap {gib(caps[d])} "
        f"(peak {gib(curves.peak[d])} at t={curves.peak_time(int(d)):,.0f} us)"
        for d in np.flatnonzero(over > 0)
    ]
    raise PartitionError(
        "could not meet the memory caps: " + "; ".join(parts) + "; raise --memory or add devices"
    )


class _Curves:
    """Bytes in use per device at every event time of one emulated schedule, and which
    buffers each op owns (see the module docstring)."""

    def __init__(
        self, graph: OpGraph, place: np.ndarray, *, start: np.ndarray, finish: np.ndarray, k: int
    ) -> None:
        buf: Buffers = buffers(graph, place, start=start, finish=finish)
        kept = _kept_until(graph, place, buf, start=start, finish=finish, k=k)
        self.times = np.unique(np.concatenate((buf.alloc_us, buf.free_us, kept)))
        self.lo = np.searchsorted(self.times, buf.alloc_us)
        self.hi = np.searchsorted(self.times, buf.free_us) + 1  # live on [lo, hi)
        # moving the owner frees [cut, hi): the buffer stays until the consumer before it
        self.cut = np.maximum(np.searchsorted(self.times, kept, side="right"), self.lo)
        self.size = buf.size.astype(np.float64)
        owner = np.where(buf.last_consumer >= 0, buf.last_consumer, buf.producer)
        self.owned = np.argsort(owner, kind="stable")
        self.owned_ptr = np.zeros(graph.num_nodes + 1, dtype=np.int64)
        np.cumsum(np.bincount(owner, minlength=graph.num_nodes), out=self.owned_ptr[1:])
        self.owner = owner
        self.residual = graph.residual_bytes.astype(np.float64)
        grid = len(self.times)
        diff = np.zeros((k, grid + 1))
        np.add.at(diff, (buf.device, self.lo), self.size)
        np.add.at(diff, (buf.device, self.hi), -self.size)
        base = np.bincount(place, weights=self.residual, minlength=k)
        self.use: np.ndarray = np.cumsum(diff[:, :grid], axis=1) + base[:, None]
        if grid == 0:
            self.use = base[:, None].astype(np.float64)
            self.times = np.zeros(1)
        self.peak = self.use.max(axis=1).astype(np.int64)

    def peak_time(self, d: int) -> float:
        return float(self.times[int(np.argmax(self.use[d]))])

    def freed_at(self, at: int, device_ops: np.ndarray) -> np.ndarray:
        """Per op (0 if not in ``device_ops``), the bytes it owns live at grid ``at``."""
        live = (self.cut <= at) & (self.hi > at)
        num = len(self.residual)
        pot = np.bincount(self.owner[live], weights=self.size[live], minlength=num) + self.residual
        keep = np.zeros(len(pot), dtype=bool)
        keep[device_ops] = True
        return np.where(keep, pot, 0.0)

    def move(self, ops: list[int], src: int, dst_of: list[int], k: int) -> None:
        """Update the estimate: the buffers and residual bytes of ``ops`` leave ``src``."""
        grid = self.use.shape[1]
        diff = np.zeros((k, grid + 1))
        for v, t in zip(ops, dst_of, strict=True):
            ids = self.owned[self.owned_ptr[v] : self.owned_ptr[v + 1]]
            for dev, sign in ((src, -1.0), (t, 1.0)):
                np.add.at(diff[dev], self.cut[ids], sign * self.size[ids])
                np.add.at(diff[dev], self.hi[ids], -sign * self.size[ids])
                diff[dev, 0] += sign * self.residual[v]
                diff[dev, grid] -= sign * self.residual[v]
        self.use += np.cumsum(diff[:, :grid], axis=1)


def _kept_until(
    graph: OpGraph,
    place: np.ndarray,
    buf: Buffers,
    *,
    start: np.ndarray,
    finish: np.ndarray,
    k: int,
) -> np.ndarray:
    """Per buffer, until when it stays on its device if its owner leaves: the start of
    the consumer there before the last one; else the producer's finish (its own output,
    held while it runs) or the buffer's allocation (a copy nobody else reads)."""
    keys = graph.src * k + place[graph.dst]
    order = np.lexsort((start[graph.dst], keys))
    keys_sorted, starts = keys[order], start[graph.dst][order]
    last = np.flatnonzero(np.r_[keys_sorted[1:] != keys_sorted[:-1], True])
    has_second = np.r_[False, keys_sorted[1:] == keys_sorted[:-1]][last]
    second = np.where(has_second, starts[np.maximum(last - 1, 0)], -np.inf)
    pair = keys_sorted[last]
    buf_keys = buf.producer * k + buf.device
    found = np.searchsorted(pair, buf_keys)
    found = np.minimum(found, max(len(pair) - 1, 0))
    match = (pair[found] == buf_keys) if len(pair) else np.zeros(len(buf_keys), dtype=bool)
    own = np.where(buf.device == place[buf.producer], finish[buf.producer], buf.alloc_us)
    kept = np.where(match, np.maximum(second[found] if len(pair) else own, own), own)
    return np.minimum(kept, buf.free_us)


def _plan(
    graph: OpGraph,
    place: np.ndarray,
    moved: np.ndarray,
    *,
    curves: _Curves,
    caps: np.ndarray,
    delay: np.ndarray,
    local: bool,
    peaks: int | None = None,
) -> np.ndarray:
    """One batch of moves planned on the estimated curves (module docstring); at most
    ``peaks`` peaks relieved (None: until the estimate fits)."""
    k = len(caps)
    trial = place.copy()
    pricer = _Pricer(graph, place, delay=delay)
    group = graph.group_of
    leader = group == np.arange(graph.num_nodes)
    members = _group_members(group) if graph.colocate.max(initial=-1) >= 0 else {}
    taken = moved.copy()
    stuck = np.zeros(k, dtype=bool)  # devices whose peak found no move this round
    for _ in range(4 * graph.num_nodes if peaks is None else peaks):
        over = np.where(stuck, -np.inf, curves.use.max(axis=1) - caps)
        d = int(np.argmax(over))
        if over[d] <= 0:
            break
        at = int(np.argmax(curves.use[d]))
        on_d = np.flatnonzero(trial == d)
        pot = curves.freed_at(at, on_d)
        group_pot = np.bincount(group, weights=pot, minlength=graph.num_nodes)
        cands = np.flatnonzero(leader & (group_pot > 0) & ~taken)
        if cands.size == 0:
            stuck[d] = True
            continue
        room = caps - (curves.use[:, at] if local else curves.use.max(axis=1))
        room[d] = -np.inf
        ops, targets = _choose(
            graph,
            trial,
            pricer,
            cands=cands,
            pot=group_pot,
            members=members,
            room=room,
            need=float(over[d]),
            taken=taken,
            device=d,
        )
        if not ops:
            stuck[d] = True
            continue
        flat_ops = [m for v in ops for m in members.get(v, (v,))]
        flat_t = [t for v, t in zip(ops, targets, strict=True) for _ in members.get(v, (v,))]
        curves.move(flat_ops, d, flat_t, k)
        trial[flat_ops] = flat_t
    return trial


def _group_members(group: np.ndarray) -> dict[int, tuple[int, ...]]:
    """Members of every colocation group of more than one op, keyed by its leader."""
    sizes = np.bincount(group, minlength=len(group))
    multi = np.flatnonzero(sizes[group] > 1)
    out: dict[int, list[int]] = {}
    for v in multi.tolist():
        out.setdefault(int(group[v]), []).append(v)
    return {g: tuple(m) for g, m in out.items()}


class _Pricer:
    """Move costs from the levels of the placed graph (crossing edges cost)."""

    def __init__(self, graph: OpGraph, place: np.ndarray, *, delay: np.ndarray) -> None:
        edge_us = delay[graph.src]
        crossing = np.where(place[graph.src] != place[graph.dst], edge_us, 0.0)
        top, bottom = longest_paths(graph, node_w=graph.time_us, edge_w=crossing)
        self.limit = float((top + bottom).max(initial=0.0))
        self.ready = (top + graph.time_us).tolist()  # finish by levels
        self.bottom = bottom.tolist()
        self.w = graph.time_us.tolist()
        self.delay = delay.tolist()
        self.in_ptr, self.preds = graph.in_ptr.tolist(), graph.preds.tolist()
        self.out_ptr, self.dst = graph.out_ptr.tolist(), graph.dst.tolist()
        self.graph, self.arrays = graph, (top + graph.time_us, bottom, delay)

    def table(self, place: np.ndarray, k: int) -> np.ndarray:
        """``cost(v, t, place)`` for every op and device, [K, V], in numpy."""
        graph = self.graph
        ready, bottom, delay = self.arrays
        preds, succs = graph.preds, graph.dst
        in_owner = graph.dst[graph.in_edges]
        here = place
        old_in = np.where(place[preds] != here[in_owner], delay[preds], 0.0)
        old_out = np.where(place[succs] != here[graph.src], delay[graph.src], 0.0)
        out = np.empty((k, graph.num_nodes))
        for t in range(k):
            c_in = np.where(place[preds] != t, delay[preds], 0.0)
            c_out = np.where(place[succs] != t, delay[graph.src], 0.0)
            before = _segment_max(ready[preds] + c_in, graph.in_ptr)
            after = _segment_max(c_out + bottom[succs], graph.out_ptr)
            added = _segment_sum(c_in - old_in, graph.in_ptr)
            added += _segment_sum(c_out - old_out, graph.out_ptr)
            longer = before + graph.time_us + after - self.limit
            out[t] = (
                np.maximum(longer, 0.0)
                + _COMM_SHARE * np.maximum(added, 0.0)
                + _WORK_SHARE * graph.time_us
            )
        return out

    def cost(self, v: int, t: int, place: np.ndarray | list[int]) -> float:
        """Lengthening of the critical path, plus small shares of comm and work."""
        delay, ready, bottom = self.delay, self.ready, self.bottom
        here = place[v]
        before, after, added = 0.0, 0.0, 0.0
        for u in self.preds[self.in_ptr[v] : self.in_ptr[v + 1]]:
            pu = place[u]
            c = delay[u] if pu != t else 0.0
            added += c - (delay[u] if pu != here else 0.0)
            x = ready[u] + c
            if x > before:
                before = x
        dv = delay[v]
        for s in self.dst[self.out_ptr[v] : self.out_ptr[v + 1]]:
            ps = place[s]
            c = dv if ps != t else 0.0
            added += c - (dv if ps != here else 0.0)
            x = c + bottom[s]
            if x > after:
                after = x
        longer = before + self.w[v] + after - self.limit
        return max(longer, 0.0) + _COMM_SHARE * max(added, 0.0) + _WORK_SHARE * self.w[v]

    def neighbours(self, v: int) -> list[int]:
        return (
            self.preds[self.in_ptr[v] : self.in_ptr[v + 1]]
            + self.dst[self.out_ptr[v] : self.out_ptr[v + 1]]
        )


def _segment_max(values: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """Per segment ``values[ptr[i]:ptr[i+1]]`` its maximum (0 if empty; values >= 0)."""
    out = np.zeros(len(ptr) - 1)
    nonempty = np.flatnonzero(ptr[1:] > ptr[:-1])
    if values.size:
        out[nonempty] = np.maximum.reduceat(values, ptr[:-1][nonempty])
    return out


def _segment_sum(values: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    cum = np.concatenate(([0.0], np.cumsum(values)))
    return cum[ptr[1:]] - cum[ptr[:-1]]


def _choose(
    graph: OpGraph,
    trial: np.ndarray,
    pricer: _Pricer,
    *,
    cands: np.ndarray,
    pot: np.ndarray,
    members: dict[int, tuple[int, ...]],
    room: np.ndarray,
    need: float,
    taken: np.ndarray,
    device: int,
) -> tuple[list[int], list[int]]:
    """Greedy min-knapsack over the candidates (two heaps, re-priced neighbours)."""
    place = trial.tolist()
    sack = _Knapsack(
        _group_costs(graph, trial, pricer, device=device, k=len(room)), pot, room, need
    )
    for v in cands.tolist():
        sack.push(v)
    is_cand = np.zeros(graph.num_nodes, dtype=bool)
    is_cand[cands] = True
    ops: list[int] = []
    targets: list[int] = []
    freed = 0.0
    while freed < need and (sack.ratio_heap or sack.big_heap):
        entry = _pop_cheaper(sack.ratio_heap, sack.big_heap, sack.best, taken)
        if entry is None:
            break
        v, t = entry
        if room[t] < sack.pot[v]:  # the room was used meanwhile: price it again
            sack.push(v)
            continue
        taken[v] = True
        group = members.get(v, (v,))
        for m in group:
            place[m] = t
            taken[m] = True
        room[t] -= sack.pot[v]
        freed += sack.pot[v]
        ops.append(v)
        targets.append(t)
        if len(group) == 1:  # neighbours on the device now save the crossing to v
            for u in pricer.neighbours(v):
                if is_cand[u] and not taken[u] and place[u] == device:
                    sack.reprice(u, t, pricer.cost(u, t, place))
    return ops, targets


def _group_costs(
    graph: OpGraph, trial: np.ndarray, pricer: _Pricer, *, device: int, k: int
) -> np.ndarray:
    """[K, V] cost of moving each group (indexed by its leader: the sum of its members')
    to each device; infinite back onto ``device``."""
    table = np.bincount(
        np.tile(graph.group_of, k) + np.repeat(np.arange(k) * graph.num_nodes, graph.num_nodes),
        weights=pricer.table(trial, k).ravel(),
        minlength=k * graph.num_nodes,
    ).reshape(k, graph.num_nodes)
    table[device] = np.inf
    return table


class _Knapsack:
    """The candidates' cheapest moves in two heaps: by cost per byte freed, and (for
    those that alone free ``need``) by cost. ``best[v]``: v's current (cost, device);
    heap entries that disagree with it are stale."""

    def __init__(self, table: np.ndarray, pot: np.ndarray, room: np.ndarray, need: float) -> None:
        self.table, self.room, self.need = table, room, need
        self.pot = pot.tolist()
        self.best: dict[int, tuple[float, int]] = {}
        self.ratio_heap: list[tuple[float, int, int]] = []
        self.big_heap: list[tuple[float, int, int]] = []

    def push(self, v: int) -> None:
        """Price ``v`` on the devices with room for it and offer the cheapest."""
        options = [
            (self.table[t, v], t) for t in range(len(self.room)) if self.room[t] >= self.pot[v]
        ]
        if options:
            cost, t = min(options)
            self._offer(v, cost, t)

    def reprice(self, u: int, t: int, new: float) -> None:
        """Offer ``u`` on ``t`` at ``new`` if that is cheaper than its best and fits."""
        cost, _ = self.best.get(u, (np.inf, -1))
        if new < cost - 1e-12 and self.room[t] >= self.pot[u]:
            self._offer(u, new, t)

    def _offer(self, v: int, cost: float, t: int) -> None:
        self.best[v] = (cost, t)
        heapq.heappush(self.ratio_heap, (cost / self.pot[v], v, t))
        if self.pot[v] >= self.need:
            heapq.heappush(self.big_heap, (cost, v, t))


def _pop_cheaper(
    ratio_heap: list[tuple[float, int, int]],
    big_heap: list[tuple[float, int, int]],
    best: dict[int, tuple[float, int]],
    taken: np.ndarray,
) -> tuple[int, int] | None:
    """Pop the valid top of both heaps with the lower move cost."""

    def clean(heap: list[tuple[float, int, int]]) -> None:
        while heap and (taken[heap[0][1]] or best.get(heap[0][1], (0, -1))[1] != heap[0][2]):
            heapq.heappop(heap)

    clean(ratio_heap)
    clean(big_heap)
    if not ratio_heap and not big_heap:
        return None
    a = ratio_heap[0] if ratio_heap else None
    b = big_heap[0] if big_heap else None
    if b is None or (a is not None and best[a[1]][0] <= best[b[1]][0]):
        assert a is not None
        heapq.heappop(ratio_heap)
        return a[1], a[2]
    heapq.heappop(big_heap)
    return b[1], b[2]
