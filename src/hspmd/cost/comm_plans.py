"""What a resolved ``CommPlan`` costs: the runtime's plans priced by the cluster's lines.

Each step is priced as the runtime issues it (``hspmd.runtime.collectives``,
``hspmd.runtime.slices``, ``hspmd.runtime.batched``)::

    step                  the runtime issues                       priced
    all-reduce, reduce-   one collective per group, the groups     the slowest group's line
    scatter, all-gather,  side by side                             (``CostModel.collective``,
    all-to-all                                                     ``concurrent``: the groups)
    split-all-reduce      one all_reduce per distinct rank set,    per rank the sum over its
                          a rank's sets one after another          sets; the slowest rank
    send-recv, bsr,       one batch of messages, one packed        per rank max(sent, received),
    split-reduce-scatter, buffer per peer                          each the sum over its peers
    split-all-gather                                               of the send-recv line
    local                 nothing                                  0

A plan's steps run one after another (their times add). ``batch_seconds`` prices plans
started as one batch (ZeRO's buckets, ``start_plans``): the point-to-point ones share one
exchange, so their messages are summed per peer pair before pricing; reduce-scatters and
all-gathers over the same groups are packed into one collective of their bytes; the others
run alone.
A collective's ``nbytes`` follows the cost lines' convention (``hspmd.cost.profile.bus_bytes``):
the input piece for reductions and all-to-all, the gathered tensor for an all-gather. Every
line is ``transfer_time`` (``hspmd.cost.link``); point-to-point messages are priced all at
once per link (numpy), so a plan of 32,000 messages costs milliseconds. A ``PlanPricer``
keeps each plan's price and messages by identity: resolution's cache gives one object to
every parameter of the same annotations and shape (every layer of a stage), so a
strategy's thousands of plans are priced a few dozen times, and ``PlanPricer.of`` shares one
pricer between the calls on the same cost (a planner search's ``predict`` calls).

>>> import math
>>> from hspmd.annotation import parse_annotation as A
>>> from hspmd.comm.resolve import resolve
>>> from hspmd.cost.cluster import load_cluster
>>> from hspmd.cost.lines import CostModel
>>> cost = CostModel.of(load_cluster("hetu-h800-h20"))
>>> plan = resolve(A("hP: [0,1]{0:2} [2,3]{0:2}"), A("hD: [0,1]{0:2} [2,3]{0:2}"), (1024, 1024))
>>> plan.kinds
('all-reduce',)
>>> plan_seconds(plan, cost, element_bytes=4) == cost.collective("all-reduce", 2 << 20, (0, 2), 2)
True
>>> scatter = resolve(A("hP: [0,1]{0:2} [2,3]{0:2}"), A("h1: [0,1]{0:2} [2,3]{0:2}"), (1024, 1024))
>>> scatter.kinds
('reduce-scatter',)
>>> plan_seconds(scatter, cost, element_bytes=4) == cost.collective("reduce-scatter", 2 << 20, (0, 2), 2)
True
>>> uneven = resolve(A("hP: [0,1]{0:2} [2,3]{0:2}"), A("h1(256,768): [0,1]{0:2} [2,3]{0:2}"), (1024, 1024))
>>> uneven.kinds  # rank 0 sends 3/4 of its rows' sum to rank 2, which sends 1/4 back
('split-reduce-scatter',)
>>> math.isclose(plan_seconds(uneven, cost, element_bytes=4), cost.send(3 << 19, 0, 2))
True
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hspmd.annotation import Annotation
from hspmd.comm.plan import (
    AllGather,
    BatchedSendRecv,
    CommPlan,
    GroupCollective,
    Local,
    ReduceScatter,
    SendRecv,
    SplitAllGather,
    SplitAllReduce,
    SplitReduceScatter,
    Step,
    volume,
)
from hspmd.cost.lines import CostModel
from hspmd.cost.link import transfer_time
from hspmd.cost.profile import Fit

__all__ = ["PlanPricer", "batch_seconds", "messages", "plan_seconds"]


def plan_seconds(plan: CommPlan, cost: CostModel, *, element_bytes: int) -> float:
    """Seconds of ``plan`` on ``cost``'s cluster, its elements of ``element_bytes`` each."""
    return PlanPricer(cost).plan(plan, element_bytes=element_bytes)


def batch_seconds(plans: Sequence[CommPlan], cost: CostModel, *, element_bytes: int) -> float:
    """Seconds of ``plans`` started as one batch (module docstring)."""
    return PlanPricer(cost).batch(plans, element_bytes=element_bytes)


@dataclass(frozen=True, slots=True, eq=False)
class Fan:
    """Messages from every rank of ``senders`` to every rank of ``receivers`` but itself,
    each of ``elements[receiver]`` elements (``to``: a split reduce-scatter's contributors
    into their roots) or ``elements[sender]`` (a split all-gather's owners out to the
    holders). Both rank arrays sorted and unique. A split collective over 1024 replicas
    is 8 fans, not 8 million messages: a fan is priced in closed form per rank."""

    senders: np.ndarray
    receivers: np.ndarray
    elements: np.ndarray
    to: bool

    @property
    def key(self) -> tuple[bytes, bytes]:
        """Its pairs, as a key: fans of one batch with the same pairs post one message."""
        return self.senders.tobytes(), self.receivers.tobytes()

    def pairs(self, ranks: int) -> np.ndarray:
        """Its pair codes ``sender * ranks + receiver``, listed (for overlaps)."""
        codes = (self.senders[:, None] * ranks + self.receivers[None, :]).ravel()
        return codes[
            np.repeat(self.senders, len(self.receivers))
            != np.tile(self.receivers, len(self.senders))
        ]


@dataclass(frozen=True, slots=True, eq=False)
class _Flows:
    """A point-to-point plan's messages: ``pairs`` listed (codes ``sender * ranks +
    receiver``, sorted, unique; send-recv and BSR) with their lines' per-message cost, and
    ``fans`` (split collectives); per rank the seconds per element it sends and receives
    (the lines' slopes; linear, so a batch adds them up)."""

    pairs: np.ndarray
    latency: np.ndarray  # per listed pair: its line's per-message cost
    fans: tuple[Fan, ...]
    sent: np.ndarray
    received: np.ndarray


class PlanPricer:
    """Prices plans on ``cost``'s cluster, keeping each plan's price and messages (module
    docstring). The plans it has priced stay alive with it.

    A batch's time per rank is ``max(sent, received)``, each a sum over its peers of
    ``latency + per_byte * bytes``: the per-byte part adds up plan by plan (kept per plan
    as ``_Flows``), the latencies count each pair of the batch once (kept per set of
    distinct plans: the buckets of one stage hold the same plans in other numbers)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._prices: dict[tuple[int, int], tuple[CommPlan, float]] = {}
        self._flows: dict[int, tuple[CommPlan, _Flows]] = {}
        self._latencies: dict[frozenset[int], tuple[np.ndarray, np.ndarray]] = {}
        self._by_node: tuple[np.ndarray, np.ndarray] | None = None
        self._nodes = np.array([cost.node_of(r) for r in range(cost.num_ranks)], dtype=np.int64)
        self.kept_bytes = 0  # of the arrays it keeps (``of``)

    @staticmethod
    def of(cost: CostModel) -> PlanPricer:
        """The pricer of ``cost``, shared by the calls that pass the same ``cost`` object one
        after another (a planner search's many ``predict`` calls): resolution's cache gives
        them the same plan objects, priced once. One pricer is kept, the last cost's, and
        replaced by a fresh one once its arrays pass ``SHARED_BYTES`` (at 65,536 ranks one
        plan's per-rank arrays take a megabyte)."""
        if _SHARED and _SHARED[0].cost is cost and _SHARED[0].kept_bytes <= SHARED_BYTES:
            return _SHARED[0]
        _SHARED[:] = [PlanPricer(cost)]
        return _SHARED[0]

    def plan(self, plan: CommPlan, *, element_bytes: int) -> float:
        """``plan``'s seconds: its steps one after another."""
        key = (id(plan), element_bytes)
        if key not in self._prices:
            total = 0.0
            for index, step in enumerate(plan.steps):
                if isinstance(step, Local):
                    continue
                if isinstance(step, GroupCollective):
                    before = plan.layouts[index]
                    total += _group_seconds(step, [(before, plan.shape)], self.cost, element_bytes)
                elif isinstance(step, SplitAllReduce):
                    total += _split_all_reduce_seconds(step, self.cost, element_bytes)
                elif len(plan.steps) == 1:
                    total += self.batch([plan], element_bytes=element_bytes)
                else:
                    flows = self._flows_of(step, plan.layouts[index], plan.shape)
                    total += self._p2p({id(step): (flows, 1)}, element_bytes)
            self._prices[key] = (plan, total)
        return self._prices[key][1]

    def batch(self, plans: Sequence[CommPlan], *, element_bytes: int) -> float:
        """``plans`` started as one batch: the point-to-point ones' messages summed per pair,
        the reduce-scatters and all-gathers over the same groups as one collective of their
        bytes (``start_plans`` packs them), the others alone."""
        p2p: dict[int, tuple[_Flows, int]] = {}
        packed: dict[tuple[str, tuple[tuple[int, ...], ...]], list[CommPlan]] = {}
        alone = 0.0
        for plan in plans:
            step = plan.steps[0] if len(plan.steps) == 1 else None
            if isinstance(step, ReduceScatter | AllGather):
                packed.setdefault((step.kind, step.groups), []).append(plan)
                continue
            if not isinstance(step, SplitReduceScatter | SplitAllGather):
                alone += self.plan(plan, element_bytes=element_bytes)
                continue
            if id(plan) not in self._flows:
                self._flows[id(plan)] = (plan, self._flows_of(step, plan.layouts[0], plan.shape))
            flows, count = p2p.get(id(plan), (self._flows[id(plan)][1], 0))
            p2p[id(plan)] = (flows, count + 1)
        for same in packed.values():  # one-step collectives over the same groups
            step = same[0].steps[0]
            assert isinstance(step, GroupCollective)
            pieces = [(p.src, p.shape) for p in same]
            alone += _group_seconds(step, pieces, self.cost, element_bytes)
        return alone + (self._p2p(p2p, element_bytes) if p2p else 0.0)

    def _flows_of(self, step: Step, before: Annotation, shape: tuple[int, ...]) -> _Flows:
        n = self.cost.num_ranks
        split = isinstance(step, SplitReduceScatter | SplitAllGather)
        fans = fans_of(step) if isinstance(step, SplitReduceScatter | SplitAllGather) else ()
        table = np.zeros((0, 3), dtype=np.int64) if split else messages(step, before, shape)
        codes = table[:, 0] * n + table[:, 1]
        order = np.argsort(codes)  # integer sums below: any order of equal codes is exact
        codes = codes[order]
        starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]]) if len(codes) else codes
        pairs = codes[starts]
        elements = np.add.reduceat(table[order, 2], starts) if len(codes) else np.zeros(0)
        latency, slope = self._lines(pairs)
        sent = np.bincount(pairs // n, weights=slope * elements, minlength=n).astype(float)
        received = np.bincount(pairs % n, weights=slope * elements, minlength=n).astype(float)
        per_byte = self._rows(1)
        for fan in fans:
            _add_fan(fan, self._nodes, per_byte, sent, received)
            self.kept_bytes += fan.senders.nbytes + fan.receivers.nbytes + fan.elements.nbytes
        self.kept_bytes += pairs.nbytes + latency.nbytes + sent.nbytes + received.nbytes
        return _Flows(pairs, latency, fans, sent, received)

    def _rows(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """The send-recv lines' ``row`` (0: latency, 1: seconds per byte): within each
        rank's node (by rank), and from each node to another (by node)."""
        if self._by_node is None:
            self._by_node = self._node_lines()
        return self._by_node[0][row], self._by_node[1][row]

    def _lines(self, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per pair code, the send-recv line of its link: (latency, seconds per byte). The
        link is the sender kind's within a node, the sender node's across nodes."""
        if self._by_node is None:
            self._by_node = self._node_lines()
        intra, inter = self._by_node
        n = self.cost.num_ranks
        src, dst = pairs // n, pairs % n
        node = self._nodes[src]
        same = node == self._nodes[dst]
        latency = np.where(same, intra[0][src], inter[0][node])
        return latency, np.where(same, intra[1][src], inter[1][node])

    def _node_lines(self) -> tuple[np.ndarray, np.ndarray]:
        """(latency, per byte) of the send-recv line within each rank's node (by rank) and
        from each node to another (by node): ``transfer_time``'s two terms."""
        cost, nodes = self.cost, self._nodes
        first = {int(node): rank for rank, node in reversed(list(enumerate(nodes)))}
        intra = np.zeros((cost.num_ranks, 2))
        inter = np.zeros((int(nodes.max()) + 1, 2))
        for rank in range(cost.num_ranks):
            peer = (
                rank + 1
                if rank + 1 < cost.num_ranks and nodes[rank + 1] == nodes[rank]
                else rank - 1
            )
            if peer >= 0 and nodes[peer] == nodes[rank]:
                intra[rank] = _terms(cost.link_between(rank, peer).line("send-recv", 2))
        for node, rank in first.items():
            other = next((r for n, r in first.items() if n != node), None)
            if other is not None:
                inter[node] = _terms(cost.link_between(rank, other).line("send-recv", 2))
        return intra.T.copy(), inter.T.copy()  # (latency row, per-byte row)

    def _p2p(self, batch: dict[int, tuple[_Flows, int]], element_bytes: int) -> float:
        """One batch of ``flows`` (each ``count`` times): per rank max(sent, received); the
        slowest rank."""
        key = frozenset(batch)
        if key not in self._latencies:
            self._latencies[key] = self._batch_latency([flows for flows, _ in batch.values()])
            self.kept_bytes += 16 * self.cost.num_ranks
        sent, received = (a.copy() for a in self._latencies[key])
        for flows, count in batch.values():
            sent += flows.sent * (count * element_bytes)
            received += flows.received * (count * element_bytes)
        return float(np.maximum(sent, received).max())

    def _batch_latency(self, batch: Sequence[_Flows]) -> tuple[np.ndarray, np.ndarray]:
        """Per rank the per-message costs it sends and receives in one batch of ``flows``:
        a pair posts one message however many plans or fans it carries. Fans with the same
        pairs count once; a fan whose pairs meet another's or a listed pair is listed."""
        n = self.cost.num_ranks
        fans = list({fan.key: fan for flows in batch for fan in flows.fans}.values())
        pairs = np.concatenate([flows.pairs for flows in batch])
        latency = np.concatenate([flows.latency for flows in batch])
        meeting = _meeting(fans, pairs, n)
        if meeting:
            listed = np.concatenate([fans[i].pairs(n) for i in sorted(meeting)])
            pairs = np.concatenate([pairs, listed])
            latency = np.concatenate([latency, self._lines(listed)[0]])
        if len(batch) > 1 or meeting:  # a pair of several plans posts one message
            order = np.argsort(pairs, kind="stable")
            pairs, latency = pairs[order], latency[order]
            first = np.r_[True, pairs[1:] != pairs[:-1]] if len(pairs) else pairs
            pairs, latency = pairs[first], latency[first]
        sent = np.bincount(pairs // n, weights=latency, minlength=n).astype(float)
        received = np.bincount(pairs % n, weights=latency, minlength=n).astype(float)
        for index, fan in enumerate(fans):
            if index not in meeting:
                ones = Fan(fan.senders, fan.receivers, np.ones(len(fan.senders)), to=False)
                _add_fan(ones, self._nodes, self._rows(0), sent, received)
        return sent, received


_SHARED: list[PlanPricer] = []  # PlanPricer.of's last pricer
# the arrays a shared pricer keeps before it is replaced (a plan search at 4096 ranks: 842 MB)
SHARED_BYTES = 1 << 30


def _terms(line: Fit) -> tuple[float, float]:
    """``transfer_time(n) = latency + per_byte * n`` of ``line``, as its two terms."""
    latency = transfer_time(0.0, per_byte=line.per_unit_s, latency=line.overhead_s)
    return latency, transfer_time(1.0, per_byte=line.per_unit_s)


def _group_seconds(
    step: GroupCollective, pieces: Sequence[tuple[Annotation, tuple[int, ...]]],
    cost: CostModel, element_bytes: int,
) -> float:  # fmt: skip
    """The slowest group: each runs the collective on its members' pieces of every
    ``(layout, shape)`` in ``pieces`` (one tensor, or the tensors ``start_plans`` packs
    into one collective)."""
    slowest = 0.0
    for group in step.groups:
        n = sum(volume(a.piece(group[0], shape).region) for a, shape in pieces) * element_bytes
        if isinstance(step, AllGather):
            n *= len(group)  # the line's bytes are the gathered tensor's
        slowest = max(slowest, cost.collective(step.kind, n, group, len(step.groups)))
    return slowest


def _split_all_reduce_seconds(step: SplitAllReduce, cost: CostModel, element_bytes: int) -> float:
    """One all-reduce per distinct rank set of the packed slices; each rank runs its sets
    one after another, so ``sets / (most sets of one rank)`` rings run side by side."""
    elements: dict[tuple[int, ...], int] = defaultdict(int)
    for s in step.slices:
        elements[tuple(sorted(s.ranks))] += volume(s.region)
    if not elements:
        return 0.0
    sets_of: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for ranks in elements:
        for rank in ranks:
            sets_of[rank].append(ranks)
    side_by_side = math.ceil(len(elements) / max(len(v) for v in sets_of.values()))
    seconds = {
        ranks: cost.collective("all-reduce", n * element_bytes, ranks, side_by_side)
        for ranks, n in elements.items()
    }
    return max(sum(seconds[s] for s in sets) for sets in sets_of.values())


def messages(step: Step, before: Annotation, shape: tuple[int, ...]) -> np.ndarray:
    """Rows ``(sender, receiver, elements)`` of a send-recv or BSR step, one per message
    the runtime queues (``hspmd.runtime.slices``); local copies left out."""
    if isinstance(step, SendRecv):
        pairs = [(s, d, volume(before.piece(s, shape).region)) for s, d in step.pairs if s != d]
    elif isinstance(step, BatchedSendRecv):
        pairs = [(t.src, t.dst, volume(t.region)) for t in step.transfers if t.src != t.dst]
    else:
        raise TypeError(f"{step.kind} is not a listed point-to-point step")
    return np.array(pairs, dtype=np.int64).reshape(-1, 3)


def fans_of(step: SplitReduceScatter | SplitAllGather) -> tuple[Fan, ...]:
    """A split collective's messages as fans (``Fan``): a split reduce-scatter's slices
    with one contributor tuple (resolution shares it between the roots of a TP position)
    are one fan into their roots, a split all-gather's slice one fan out of its owners."""
    if isinstance(step, SplitAllGather):
        out = []
        for s in step.slices:
            owned: dict[int, int] = defaultdict(int)
            for owner, region in s.owners:
                owned[owner] += volume(region)
            senders = np.fromiter(sorted(owned), dtype=np.int64, count=len(owned))
            sizes = np.array([owned[o] for o in sorted(owned)], dtype=np.float64)
            out.append(Fan(senders, np.asarray(s.ranks, dtype=np.int64), sizes, to=False))
        return tuple(out)
    groups: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, ...], dict[int, int]]] = {}
    for s in step.slices:
        ranks, roots = groups.setdefault((id(s.ranks), s.zero), (s.ranks, defaultdict(int)))
        roots[s.root] += volume(s.region)
    out = []
    for (_, zero), (ranks, roots) in groups.items():
        senders = np.asarray(ranks, dtype=np.int64)
        if zero:
            senders = senders[~np.isin(senders, zero)]
        receivers = np.fromiter(sorted(roots), dtype=np.int64, count=len(roots))
        sizes = np.array([roots[r] for r in sorted(roots)], dtype=np.float64)
        out.append(Fan(senders, receivers, sizes, to=True))
    return tuple(out)


def _member(ranks: np.ndarray, among: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of sorted ``ranks`` are in sorted ``among``, and where (valid where found)."""
    if not len(among):
        return np.zeros(len(ranks), dtype=bool), np.zeros(len(ranks), dtype=np.int64)
    at = np.minimum(np.searchsorted(among, ranks), len(among) - 1)
    return among[at] == ranks, at


def _add_fan(
    fan: Fan, nodes: np.ndarray, line: tuple[np.ndarray, np.ndarray], sent: np.ndarray,
    received: np.ndarray,
) -> None:  # fmt: skip
    """Add ``fan``'s cost per rank on ``line`` (within a node by sender, across nodes by
    the sender's node) to ``sent`` and ``received``, in closed form: per rank its own pair
    is left out and the rest summed per node, so a fan of S senders and R receivers costs
    O(S + R + nodes), not O(S x R)."""
    within, across = line
    S, R, e = fan.senders, fan.receivers, fan.elements
    node_s, node_r = nodes[S], nodes[R]
    count = len(across)
    a, b = within[S], across[node_s]  # each sender's slope within its node and out of it
    s_in_r, s_at = _member(S, R)
    r_in_s, r_at = _member(R, S)
    if fan.to:  # pair (s, r) carries e[r]
        e_node = np.bincount(node_r, weights=e, minlength=count)
        e_self = np.where(s_in_r, e[s_at], 0.0)
        sent[S] += a * (e_node[node_s] - e_self) + b * (e.sum() - e_node[node_s])
        a_node = np.bincount(node_s, weights=a, minlength=count)
        b_node = np.bincount(node_s, weights=b, minlength=count)
        a_self = np.where(r_in_s, a[r_at], 0.0)
        received[R] += e * (a_node[node_r] - a_self + b.sum() - b_node[node_r])
    else:  # pair (s, r) carries e[s]
        r_node = np.bincount(node_r, minlength=count)
        sent[S] += e * (a * (r_node[node_s] - s_in_r) + b * (len(R) - r_node[node_s]))
        ae_node = np.bincount(node_s, weights=a * e, minlength=count)
        be_node = np.bincount(node_s, weights=b * e, minlength=count)
        ae_self = np.where(r_in_s, (a * e)[r_at], 0.0)
        received[R] += ae_node[node_r] - ae_self + (b * e).sum() - be_node[node_r]


def _meeting(fans: Sequence[Fan], pairs: np.ndarray, ranks: int) -> set[int]:
    """The fans (indices) with a pair that another fan or ``pairs`` also has: those that
    share a receiver and a sender other than that receiver."""
    out: set[int] = set()
    if not fans:
        return out
    if len(pairs):
        src, dst = pairs // ranks, pairs % ranks
        out |= {
            i
            for i, f in enumerate(fans)
            if np.any(np.isin(src, f.senders) & np.isin(dst, f.receivers))
        }
    if len(fans) < 2:
        return out
    owner = np.repeat(np.arange(len(fans)), [len(f.receivers) for f in fans])
    receiver = np.concatenate([f.receivers for f in fans])
    order = np.argsort(receiver, kind="stable")
    receiver, owner = receiver[order], owner[order]
    bounds = np.flatnonzero(np.r_[True, receiver[1:] != receiver[:-1], True])
    candidates: set[tuple[int, int]] = set()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end - start > 1:  # a receiver of several fans
            candidates |= set(itertools.combinations(sorted(set(owner[start:end].tolist())), 2))
    for i, j in candidates:
        both_s = np.intersect1d(fans[i].senders, fans[j].senders, assume_unique=True)
        both_r = np.intersect1d(fans[i].receivers, fans[j].receivers, assume_unique=True)
        lone = len(both_s) == 1 and len(both_r) == 1 and both_s[0] == both_r[0]
        if len(both_s) and len(both_r) and not lone:
            out |= {i, j}
    return out
