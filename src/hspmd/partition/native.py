"""Compiled kernels for the partitioner's hottest loops, when numba is installed.

numba is optional (``pip install numba``): without it, or with ``HSPMD_NO_NUMBA=1`` in
the environment, :data:`ENABLED` is False and every caller runs its pure-Python loop.
Each kernel is the same loop as the Python one it replaces, with the same float
operations in the same order (no fastmath), so the results are identical; the Python
paths stay as the reference (``tests/partition/test_native.py`` checks equality).
Compiled code is cached next to this file (``cache=True``), so only the first run on a
machine pays the compilation (a few seconds).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

ENABLED = False
_njit: Any = None
if os.environ.get("HSPMD_NO_NUMBA", "") in ("", "0"):
    try:
        from numba import njit as _njit  # type: ignore[import-not-found,no-redef,unused-ignore]

        ENABLED = True
    except ImportError:  # pragma: no cover - depends on the machine
        ENABLED = False


def _jit(fn: Any) -> Any:
    return _njit(cache=True, nogil=True)(fn) if ENABLED else fn


def _jit_inline(fn: Any) -> Any:
    """For a kernel's steps: inlined into the caller by numba, no call left."""
    return _njit(cache=True, nogil=True, inline="always")(fn) if ENABLED else fn


# --- a binary min-heap over (float key, float key, int id), in three arrays ----------


@_jit
def _less(ka: np.ndarray, kb: np.ndarray, ids: np.ndarray, i: int, j: int) -> bool:
    if ka[i] != ka[j]:
        return ka[i] < ka[j]
    if kb[i] != kb[j]:
        return kb[i] < kb[j]
    return ids[i] < ids[j]


@_jit
def _swap(ka: np.ndarray, kb: np.ndarray, ids: np.ndarray, i: int, j: int) -> None:
    ka[i], ka[j] = ka[j], ka[i]
    kb[i], kb[j] = kb[j], kb[i]
    ids[i], ids[j] = ids[j], ids[i]


@_jit
def _push(
    ka: np.ndarray, kb: np.ndarray, ids: np.ndarray, n: int, a: float, b: float, x: int
) -> int:
    ka[n], kb[n], ids[n] = a, b, x
    i = n
    while i > 0:
        p = (i - 1) >> 1
        if _less(ka, kb, ids, i, p):
            _swap(ka, kb, ids, i, p)
            i = p
        else:
            break
    return n + 1


@_jit
def _pop(ka: np.ndarray, kb: np.ndarray, ids: np.ndarray, n: int) -> int:
    """Move the top to slot ``n - 1`` and restore the heap on ``0..n-2``; returns n - 1."""
    n -= 1
    _swap(ka, kb, ids, 0, n)
    i = 0
    while True:
        left = 2 * i + 1
        if left >= n:
            break
        c = left
        if left + 1 < n and _less(ka, kb, ids, left + 1, left):
            c = left + 1
        if _less(ka, kb, ids, c, i):
            _swap(ka, kb, ids, c, i)
            i = c
        else:
            break
    return n


# --- kernels ---------------------------------------------------------------------------


@_jit
def longest_paths_kernel(
    src: np.ndarray, dst: np.ndarray, forward: np.ndarray, backward: np.ndarray, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Finish (top level + own weight) and bottom level; edges sorted by source rank."""
    finish = weights.copy()
    for e in range(len(src)):
        x = finish[src[e]] + forward[e]
        if x > finish[dst[e]]:
            finish[dst[e]] = x
    bottom = weights.copy()
    for e in range(len(src) - 1, -1, -1):
        x = bottom[dst[e]] + backward[e]
        if x > bottom[src[e]]:
            bottom[src[e]] = x
    return finish, bottom


@_jit
def schedule_kernel(
    dev: np.ndarray,
    dur: np.ndarray,
    delay: np.ndarray,
    rank: np.ndarray,
    out_ptr: np.ndarray,
    dst: np.ndarray,
    in_degree: np.ndarray,
    num_devices: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``emulate.schedule``: the same events in the same order, one array heap of
    events (time, kind, payload) and one of ready ops (ready, rank, op) per device."""
    num = len(dev)
    remaining = in_degree.copy()
    ready = np.zeros(num)
    start = np.zeros(num)
    finish = np.zeros(num)
    busy = np.zeros(num_devices, dtype=np.bool_)
    base = _slot_bases(dev, num_devices)
    qa, qb, qi = np.empty(num), np.empty(num), np.empty(num, dtype=np.int64)
    qn = np.zeros(num_devices, dtype=np.int64)
    cap = 3 * num + num_devices + 1  # every push: K device starts, <= 3 per op
    ea, eb, ei = np.empty(cap), np.empty(cap), np.empty(cap, dtype=np.int64)
    en = 0
    for v in range(num):
        if remaining[v] == 0:
            _push_ready(qa, qb, qi, qn, base[dev[v]], dev[v], 0.0, float(rank[v]), v)
    for d in range(num_devices):
        en = _push(ea, eb, ei, en, 0.0, 1.0, d)
    while en > 0:
        en = _pop(ea, eb, ei, en)
        now, kind, item = ea[en], eb[en], ei[en]
        if kind == 0.0:
            d = dev[item]
            busy[d] = False
            en = _push(ea, eb, ei, en, now, 1.0, d)
            arrive = now + delay[item]
            for e in range(out_ptr[item], out_ptr[item + 1]):
                u = dst[e]
                t = now if dev[u] == d else arrive
                if t > ready[u]:
                    ready[u] = t
                remaining[u] -= 1
                if remaining[u] == 0:
                    du = dev[u]
                    lo = base[du]
                    qn[du] = _push(qa[lo:], qb[lo:], qi[lo:], qn[du], ready[u], float(rank[u]), u)
                    en = _push(ea, eb, ei, en, ready[u], 1.0, du)
            continue
        lo = base[item]
        if busy[item] or qn[item] == 0 or qa[lo] > now:
            continue
        qn[item] = _pop(qa[lo:], qb[lo:], qi[lo:], qn[item])
        v = qi[lo + qn[item]]
        start[v] = now
        finish[v] = now + dur[v]
        busy[item] = True
        en = _push(ea, eb, ei, en, finish[v], 0.0, v)
    return start, finish


@_jit_inline
def _slot_bases(dev: np.ndarray, num_devices: int) -> np.ndarray:
    """Per-device ready heaps share one buffer: device d owns slots [base[d], base[d+1])."""
    count = np.zeros(num_devices + 1, dtype=np.int64)
    for v in range(len(dev)):
        count[dev[v] + 1] += 1
    return np.cumsum(count)


@_jit_inline
def _push_ready(
    qa: np.ndarray,
    qb: np.ndarray,
    qi: np.ndarray,
    qn: np.ndarray,
    lo: int,
    d: int,
    a: float,
    b: float,
    x: int,
) -> None:
    """Push (a, b, x) on device ``d``'s ready heap, the one starting at slot ``lo``."""
    qn[d] = _push(qa[lo:], qb[lo:], qi[lo:], qn[d], a, b, x)


@_jit
def eft_kernel(
    num_devices: int,
    pin: np.ndarray,
    group: np.ndarray,
    out_ptr: np.ndarray,
    dst: np.ndarray,
    in_ptr: np.ndarray,
    preds: np.ndarray,
    dur: np.ndarray,
    delay: np.ndarray,
    rank: np.ndarray,
    in_degree: np.ndarray,
) -> np.ndarray:
    """``eft.eft_placement`` without caps: the same loop over one array heap."""
    num = len(dur)
    remaining = in_degree.copy()
    group_dev = np.full(num, -1, dtype=np.int64)
    place = np.zeros(num, dtype=np.int64)
    finish = np.zeros(num)
    data_ready = np.zeros(num)
    free = np.zeros(num_devices)
    arrive = np.zeros(num_devices)
    ha, hb, hi = np.empty(num), np.empty(num), np.empty(num, dtype=np.int64)
    n = 0
    for v in range(num):
        if remaining[v] == 0:
            n = _push(ha, hb, hi, n, 0.0, float(rank[v]), v)
    while n > 0:
        n = _pop(ha, hb, hi, n)
        v = hi[n]
        _arrivals(v, in_ptr, preds, place, finish, delay, arrive)
        forced = group_dev[group[v]] if group_dev[group[v]] >= 0 else pin[v]
        best = forced if forced >= 0 else _earliest_start(arrive, free)
        group_dev[group[v]] = best
        place[v] = best
        finish[v] = max(arrive[best], free[best]) + dur[v]
        free[best] = finish[v]
        done = finish[v]
        for e in range(out_ptr[v], out_ptr[v + 1]):
            u = dst[e]
            if done > data_ready[u]:
                data_ready[u] = done
            remaining[u] -= 1
            if remaining[u] == 0:
                n = _push(ha, hb, hi, n, data_ready[u], float(rank[u]), u)
    return place


@_jit_inline
def _arrivals(
    v: int,
    in_ptr: np.ndarray,
    preds: np.ndarray,
    place: np.ndarray,
    finish: np.ndarray,
    delay: np.ndarray,
    arrive: np.ndarray,
) -> None:
    """``eft.arrivals`` into ``arrive``: when ``v``'s inputs are there, per device."""
    arrive[:] = 0.0
    top_t, top_d, second = 0.0, -1, 0.0
    for e in range(in_ptr[v], in_ptr[v + 1]):
        u = preds[e]
        pu, fu = place[u], finish[u]
        if fu > arrive[pu]:
            arrive[pu] = fu
        t = fu + delay[u]
        if t > top_t:
            if pu != top_d:
                second = top_t
            top_t, top_d = t, pu
        elif pu != top_d and t > second:
            second = t
    for d in range(len(arrive)):
        t = second if d == top_d else top_t
        if t > arrive[d]:
            arrive[d] = t


@_jit_inline
def _earliest_start(arrive: np.ndarray, free: np.ndarray) -> int:
    """``eft._earliest_start`` over all devices: the first to start, lowest on a tie."""
    best, begin = -1, np.inf
    for d in range(len(arrive)):
        t = arrive[d] if arrive[d] > free[d] else free[d]
        if t < begin:
            best, begin = d, t
    return best


# --- LALB and cluster remapping (mapping.py, refine.py) over Fenwick trees ----------


def fenwick_trees(values: np.ndarray, device: np.ndarray, k: int) -> np.ndarray:
    """``mapping.DeviceWork(values, device, k=k).trees`` as one (k, n + 1) array."""
    n = len(values)
    index = np.arange(1, n + 1)
    trees = np.zeros((k, n + 1))
    for d in range(k):
        prefix = np.concatenate(([0.0], np.cumsum(np.where(device == d, values, 0.0))))
        trees[d, 1:] = prefix[index] - prefix[index - (index & -index)]
    return trees


@_jit
def _range_sums(trees: np.ndarray, lo: int, hi: int, out: np.ndarray) -> None:
    """``DeviceWork.range_sums``: the same walk, the same order of additions."""
    out[:] = 0.0
    if hi <= lo:
        return
    plus = np.empty(64, dtype=np.int64)
    minus = np.empty(64, dtype=np.int64)
    np_, nm = 0, 0
    while hi > lo:
        plus[np_] = hi
        np_ += 1
        hi &= hi - 1
    while lo > hi:
        minus[nm] = lo
        nm += 1
        lo &= lo - 1
    for d in range(trees.shape[0]):
        total = 0.0
        for j in range(np_):
            total += trees[d, plus[j]]
        for j in range(nm):
            total -= trees[d, minus[j]]
        out[d] = total


@_jit
def _tree_add(tree: np.ndarray, pos: int, value: float) -> None:
    i, n = pos + 1, len(tree) - 1
    while i <= n:
        tree[i] += value
        i += i & -i


@_jit
def initial_merge_kernel(
    num_primary: int,
    members: np.ndarray,
    ptr: np.ndarray,
    place: np.ndarray,
    bptr: np.ndarray,
    bother: np.ndarray,
    bcost: np.ndarray,
    hide: np.ndarray,
    k: int,
) -> np.ndarray:
    """``mapping._initial_merge`` (``place`` updated in place); returns the deferred."""
    num_clusters = len(ptr) - 1
    deferred = np.empty(num_clusters, dtype=np.int64)
    nd = 0
    acc = np.zeros(k)
    for c in range(num_primary, num_clusters):
        if hide[c]:
            acc[:] = 0.0
            for i in range(bptr[c], bptr[c + 1]):
                d = place[bother[i]]
                if d >= 0:
                    acc[d] += bcost[i]
            best = 0
            for d in range(1, k):
                if acc[d] > acc[best]:
                    best = d
            if acc[best] > 0.0:
                for j in range(ptr[c], ptr[c + 1]):
                    place[members[j]] = best
                continue
        deferred[nd] = c
        nd += 1
    return deferred[:nd]


@_jit
def lalb_kernel(
    clusters: np.ndarray,
    members: np.ndarray,
    ptr: np.ndarray,
    place: np.ndarray,
    trees: np.ndarray,
    bptr: np.ndarray,
    bother: np.ndarray,
    bcost: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    pos: np.ndarray,
    w: np.ndarray,
) -> None:
    """``mapping._lalb`` (``place`` and ``trees`` updated in place)."""
    k = trees.shape[0]
    acc = np.zeros(k)
    span = np.zeros(k)
    for c in clusters:
        acc[:] = 0.0
        for i in range(bptr[c], bptr[c + 1]):
            d = place[bother[i]]
            if d >= 0:
                acc[d] += bcost[i]
        total = 0.0
        for d in range(k):
            total += acc[d]
        _range_sums(trees, lo[c], hi[c], span)
        best = 0
        key0, key1 = span[0] + total - acc[0], -acc[0]
        for d in range(1, k):
            a, b = span[d] + total - acc[d], -acc[d]
            if a < key0 or (a == key0 and b < key1):
                best, key0, key1 = d, a, b
        for j in range(ptr[c], ptr[c + 1]):
            v = members[j]
            place[v] = best
            _tree_add(trees[best], pos[v], w[v])


@_jit
def remap_kernel(
    order: np.ndarray,
    members: np.ndarray,
    ptr: np.ndarray,
    place: np.ndarray,
    group_free: np.ndarray,
    work: np.ndarray,
    trees: np.ndarray,
    bptr: np.ndarray,
    bother: np.ndarray,
    bcost: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    pos: np.ndarray,
    w: np.ndarray,
) -> None:
    """``refine.remap_clusters``' loop (``place`` and ``trees`` updated in place)."""
    k = trees.shape[0]
    acc = np.zeros(k)
    own = np.zeros(k)
    span = np.zeros(k)
    cost = np.zeros(k)
    for c in order:
        here = place[members[ptr[c]]]
        skip = False
        for j in range(ptr[c], ptr[c + 1]):
            v = members[j]
            if place[v] != here or not group_free[v]:
                skip = True
                break
        if skip:
            continue
        acc[:] = 0.0
        for i in range(bptr[c], bptr[c + 1]):
            acc[place[bother[i]]] += bcost[i]
        own[:] = 0.0
        own[here] = work[c]
        total = 0.0
        for d in range(k):
            total += acc[d]
        _range_sums(trees, lo[c], hi[c], span)
        for d in range(k):
            cost[d] = span[d] - own[d] + total - acc[d]
        best = 0
        for d in range(1, k):  # min of (cost, d != here): the first lowest, here on a tie
            if cost[d] < cost[best] or (cost[d] == cost[best] and best != here and d == here):
                best = d
        if best != here and cost[best] < cost[here] - 1e-9:
            for j in range(ptr[c], ptr[c + 1]):
                v = members[j]
                place[v] = best
                _tree_add(trees[here], pos[v], -w[v])
                _tree_add(trees[best], pos[v], w[v])


@_jit
def walk_kernel(
    order: np.ndarray, out_ptr: np.ndarray, dst: np.ndarray, alive: np.ndarray, wlvl: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``slicing._walk`` from each still-alive node of ``order`` in turn (``alive``
    updated in place): the paths' nodes one after another, and each path's length."""
    members = np.empty(len(alive), dtype=np.int64)  # a walk visits alive nodes only
    sizes = np.empty(len(order), dtype=np.int64)
    m, p = 0, 0
    for start in order:
        if not alive[start]:
            continue
        begin = m
        alive[start] = False
        members[m] = start
        m += 1
        v = start
        while True:
            best, best_w = -1, -1.0
            for e in range(out_ptr[v], out_ptr[v + 1]):
                u = dst[e]
                if alive[u] and wlvl[u] > best_w:
                    best, best_w = u, wlvl[u]
            if best < 0:
                break
            alive[best] = False
            members[m] = best
            m += 1
            v = best
        sizes[p] = m - begin
        p += 1
    return members[:m], sizes[:p]


@_jit_inline
def _whole_and_free(
    members: np.ndarray, lo: int, hi: int, place: np.ndarray, group_free: np.ndarray, h: int
) -> bool:
    """Whether every member ``members[lo:hi]`` is on ``h`` and leads its own group."""
    for j in range(lo, hi):
        v = members[j]
        if place[v] != h or not group_free[v]:
            return False
    return True


@_jit_inline
def _others_by_load(load: np.ndarray, h: int, targets: np.ndarray) -> int:
    """The devices but ``h`` into ``targets`` by load, ties by index (a stable insertion
    sort); returns their number."""
    nt = 0
    for d in range(len(load)):
        if d == h:
            continue
        i = nt
        while i > 0 and load[targets[i - 1]] > load[d]:
            targets[i] = targets[i - 1]
            i -= 1
        targets[i] = d
        nt += 1
    return nt


@_jit_inline
def _entry_and_exit(
    other: np.ndarray,
    cost_of: np.ndarray,
    in_side: np.ndarray,
    place: np.ndarray,
    t: int,
    top: np.ndarray,
    bottom: np.ndarray,
    w: np.ndarray,
) -> tuple[float, float]:
    """A cluster's longest path in and out were it on ``t``, over its boundary
    (``other``, ``cost_of``, ``in_side``: one entry per crossing edge)."""
    enter, leave = 0.0, 0.0
    for i in range(len(other)):
        u = other[i]
        cost = cost_of[i] if place[u] != t else 0.0
        if in_side[i]:
            x = top[u] + w[u] + cost
            if x > enter:
                enter = x
        else:
            x = cost + bottom[u]
            if x > leave:
                leave = x
    return enter, leave


@_jit
def relieve_round_kernel(
    order: np.ndarray,
    members: np.ndarray,
    ptr: np.ndarray,
    place: np.ndarray,
    group_free: np.ndarray,
    work: np.ndarray,
    load: np.ndarray,
    cl: np.ndarray,
    bptr: np.ndarray,
    bother: np.ndarray,
    bcost: np.ndarray,
    in_side: np.ndarray,
    top: np.ndarray,
    bottom: np.ndarray,
    w: np.ndarray,
    limit: float,
) -> int:
    """One round of ``refine.relieve_busiest`` (``place`` and ``load`` updated in place);
    returns the number of clusters moved."""
    k = len(load)
    frozen = np.zeros(len(ptr) - 1, dtype=np.bool_)
    targets = np.empty(k, dtype=np.int64)
    moved = 0
    for c in order:
        h = place[members[ptr[c]]]
        if frozen[c]:
            continue
        if not _whole_and_free(members, ptr[c], ptr[c + 1], place, group_free, h):
            continue
        nt = _others_by_load(load, h, targets)
        wc = work[c]
        for j in range(nt):
            t = targets[j]
            if max(load[h] - wc, load[t] + wc) >= max(load[h], load[t]):
                break
            enter, leave = _entry_and_exit(
                bother[bptr[c] : bptr[c + 1]], bcost[bptr[c] : bptr[c + 1]],
                in_side[bptr[c] : bptr[c + 1]], place, t, top, bottom, w,
            )  # fmt: skip
            if enter + wc + leave > max(limit, max(load[h] - wc, load[t] + wc)):
                continue
            for i in range(ptr[c], ptr[c + 1]):
                place[members[i]] = t
            load[h] -= wc
            load[t] += wc
            for i in range(bptr[c], bptr[c + 1]):
                frozen[cl[bother[i]]] = True
            moved += 1
            break
    return moved


@_jit
def kahn_kernel(out_ptr: np.ndarray, dst: np.ndarray, in_degree: np.ndarray) -> np.ndarray:
    """``graph._kahn``: FIFO Kahn order, sources by index, children in edge order."""
    num = len(in_degree)
    remaining = in_degree.copy()
    order = np.empty(num, dtype=np.int64)
    tail = 0
    for v in range(num):
        if remaining[v] == 0:
            order[tail] = v
            tail += 1
    head = 0
    while head < tail:
        v = order[head]
        head += 1
        for e in range(out_ptr[v], out_ptr[v + 1]):
            u = dst[e]
            remaining[u] -= 1
            if remaining[u] == 0:
                order[tail] = u
                tail += 1
    return order[:tail]
