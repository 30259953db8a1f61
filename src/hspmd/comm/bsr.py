"""Batched send/receive (BSR): the table of finest slices and the scheme that serves it.

The *BSR table* maps every finest slice to the ranks that own it (source layout) and the
ranks that need it (destination layout). A *scheme* picks, for every (slice, needer), the
rank that sends it. ``method="heuristic"`` applies the paper's rules in order:

1. the needer owns the slice: local copy, no communication;
2. else the owner on the fastest link to the needer (NVLink before InfiniBand);
3. ties: the owner that has sent the fewest bytes so far in this scheme;
4. ties: the lowest rank.

``method="naive"`` keeps rule 1 and then always takes the lowest-rank owner (the paper's
baseline). A scheme over several tables at once is *fused*: the bytes-so-far counter is shared
by all tensors, so the load balances over the whole switch, and messages are counted once per
(sender, receiver) pair. ``fused=False`` resets the counter for every tensor (per-tensor BSR).
``hspmd.comm.relay`` turns a fused scheme into a relayed one (several rounds).

    >>> from hspmd.annotation import parse_annotation as A
    >>> table = BsrTable.between(A("[0,1]{0:2}"), A("[2,3]{D:2}"), (4, 2))
    >>> [(e.region, e.owners, e.needers) for e in table.entries]
    [(((0, 2), (0, 2)), (0,), (2, 3)), (((2, 4), (0, 2)), (1,), (2, 3))]
"""

from __future__ import annotations

import functools
import heapq
from array import array
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hspmd.annotation import PARTIAL, Annotation, Region
from hspmd.comm.plan import BatchedSendRecv, Local, Transfer, volume
from hspmd.comm.slices import holders_table, merge_boxes
from hspmd.comm.topology import Topology
from hspmd.errors import ResolutionError

METHODS = ("naive", "heuristic")


@dataclass(frozen=True, slots=True)
class BsrEntry:
    """One finest slice: who owns it before, who needs it after."""

    region: Region
    owners: tuple[int, ...]
    needers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BsrTable:
    """The BSR table of one tensor; ``itemsize`` is bytes per element (for volumes)."""

    entries: tuple[BsrEntry, ...]
    tensor: int = 0
    itemsize: int = 1

    @staticmethod
    def of(
        src_pieces: Mapping[int, Region],
        dst_pieces: Mapping[int, Region],
        shape: Sequence[int],
        *,
        tensor: int = 0,
        itemsize: int = 1,
    ) -> BsrTable:
        rows = holders_table(src_pieces, dst_pieces, shape)
        for region, owners, _ in rows:
            assert owners, f"slice {region} has no owner"
        return BsrTable(tuple(BsrEntry(*row) for row in rows), tensor, itemsize)

    @staticmethod
    def between(
        src: Annotation,
        dst: Annotation,
        shape: Sequence[int],
        *,
        tensor: int = 0,
        itemsize: int = 1,
    ) -> BsrTable:
        """The table from ``src`` to ``dst``; neither may hold partial values."""
        for name, layout in (("source", src), ("destination", dst)):
            if layout.hdim == PARTIAL or any(s.degree(PARTIAL) > 1 for s in layout.states):
                raise ResolutionError(
                    f"BSR {name} {layout} holds partial values: reduce them first "
                    "(resolve() does this for you)"
                )
        src_pieces = {r: p.region for r, p in src.pieces(shape).items()}
        dst_pieces = {r: p.region for r, p in dst.pieces(shape).items()}
        return BsrTable.of(src_pieces, dst_pieces, shape, tensor=tensor, itemsize=itemsize)


def schedule(
    tables: Sequence[BsrTable],
    *,
    topology: Topology | None = None,
    method: str = "heuristic",
    fused: bool = True,
) -> tuple[Transfer, ...]:
    """Transfers serving every (slice, needer) of ``tables``, merged into boxes per pair.

    The heuristic's rule 2 depends only on the slice's owners and the needer's node, so the
    fastest owners are found once per owner set and node, whatever the slice or tensor
    (``_Links.of``); rules 3 and 4 then take the top of a heap of (load, rank) per such set
    of owners (``_least_loaded``). At 4096 ranks (llama-70b, 64 -> 128 pipelines,
    benchmarks/metadata_scale.py) a slice has 64 owners and the switch 740,352 (slice,
    needer) pairs; rule 2 is computed 72 times (once per slice and node: 520,768). At
    65,536 ranks a slice has 1024 owners and the switch 10 million pairs: a scan of the
    owners' loads per pair took most of a minute.

    >>> from hspmd.annotation import parse_annotation as A
    >>> t = BsrTable.between(A("[0,1]{D:2}"), A("[2,3]{0:2}"), (4,))
    >>> [(x.src, x.dst, x.region) for x in schedule([t])]
    [(0, 2, ((0, 2),)), (1, 3, ((2, 4),))]
    """
    if method not in METHODS:
        raise ResolutionError(f"unknown BSR method {method!r}: use one of {', '.join(METHODS)}")
    topology = topology or Topology.flat()
    # (sender, receiver, tensor) as one int, (src * ranks + dst) * tensors + tensor: sorted
    # as the tuples would be, several times faster (a million keys at 4096 ranks)
    ranks, low, tensors = key_space(tables)
    picked = _pick(tables, topology, method=method, fused=fused, ranks=ranks, tensors=tensors)
    out = []
    for key in sorted(picked):
        boxes = picked[key]
        pair, tensor = divmod(key, tensors)
        src, dst = divmod(pair, ranks)
        for box in merge_boxes(boxes) if type(boxes) is list else (boxes,):
            out.append(Transfer(src, dst, box, tensor + low))
    return tuple(out)


def key_space(tables: Sequence[BsrTable]) -> tuple[int, int, int]:
    """1 + the highest rank, the lowest tensor index and the count of tensor indices from
    it: the sizes of ``walk``'s keys."""
    ranks = 1 + max(
        (max(max(e.owners, default=0), max(e.needers, default=0))
         for t in tables for e in t.entries), default=0,
    )  # fmt: skip
    low = min((t.tensor for t in tables), default=0)
    return ranks, low, 1 + max((t.tensor for t in tables), default=0) - low


def _pick(
    tables: Sequence[BsrTable], topology: Topology, *, method: str, fused: bool, ranks: int,
    tensors: int,
) -> dict[int, Any]:  # fmt: skip
    """``schedule``'s choice of sender per (slice, needer): key (sender, receiver, tensor)
    as one int -> its region, or a list of its regions where there are several (most have
    one: no list per key, 10 million at 65,536 ranks)."""
    picked: dict[int, Any] = {}
    keys, regions = walk(tables, topology, method=method, fused=fused, ranks=ranks,
                         tensors=tensors, local=True, sizes=False)  # fmt: skip
    for key, region in zip(keys, regions, strict=True):
        had = picked.get(key)
        if had is None:
            picked[key] = region
        elif type(had) is list:
            had.append(region)
        else:
            picked[key] = [had, region]
    return picked


def walk(
    tables: Sequence[BsrTable], topology: Topology, *, method: str, fused: bool, ranks: int,
    tensors: int, local: bool, sizes: bool,
) -> tuple[array, Any]:  # fmt: skip
    """The scheme's rules applied to every (slice, needer) of ``tables`` in order: the key
    (sender, receiver, tensor) as one int, ``(sender * ranks + receiver) * tensors +
    tensor - lowest tensor``, of each pick, and beside it the slice's region, or its bytes
    (``sizes``: an ``array('d')``); ``tensors=1`` keys pairs alone. ``local=False`` leaves local copies out (they move
    nothing and count in no sender's load, so the other picks are the same)."""
    node = functools.cache(topology.node_of)  # TopologyError for a rank on no node
    links = _Links(tables, topology) if method == "heuristic" else None
    loads = [0.0] * (links.num_ranks if links else 0)  # bytes sent so far (rule 3)
    heaps: dict[int, tuple[tuple[int, ...], list[tuple[float, int]]]] = {}
    low = min((t.tensor for t in tables), default=0)
    keys, values = array("q"), (array("d") if sizes else [])
    add_key, add_value = keys.append, values.append
    for table in tables:
        if not fused:
            loads = [0.0] * len(loads)
            heaps.clear()
        tensor = table.tensor - low if tensors > 1 else 0  # tensors=1: keys of pairs
        for entry in table.entries:
            region, owners = entry.region, entry.owners
            size = volume(region) * table.itemsize
            value: Any = size if sizes else region
            owned = frozenset(owners) if len(owners) > 4 else owners
            # needer's node -> owners on its fastest link, shared by every slice these own
            fastest = links.of(owners) if links is not None else None
            for needer in entry.needers:
                if needer in owned:
                    if not local:
                        continue
                    owner = needer
                elif fastest is None:
                    owner = owners[0]
                else:
                    ints = fastest[node(needer)]
                    if len(ints) == 1:
                        owner = ints[0]
                        loads[owner] += size
                    else:
                        owner = _least_loaded(ints, loads, heaps, size)
                add_key((owner * ranks + needer) * tensors + tensor)
                add_value(value)
    return keys, values


def _least_loaded(
    ints: tuple[int, ...], loads: list[float], heaps: dict[int, Any], size: int
) -> int:
    """Rules 3 and 4 among ``ints``: the least-loaded rank, the lowest of equals; its load
    grows by ``size``. ``heaps[id(ints)]`` keeps one (load, rank) entry per rank of
    ``ints``; loads only grow, so an entry is at most its rank's load: the first entry
    that surfaces equal to it is the minimum, the stale ones above it are refreshed."""
    found = heaps.get(id(ints))
    if found is None:
        heap = [(loads[r], r) for r in ints]
        heapq.heapify(heap)
        heaps[id(ints)] = (ints, heap)  # ints kept alive: its id stays its own
    else:
        heap = found[1]
    while heap[0][0] != loads[heap[0][1]]:
        heapq.heapreplace(heap, (loads[heap[0][1]], heap[0][1]))
    owner = heap[0][1]
    loads[owner] += size
    heapq.heapreplace(heap, (loads[owner], owner))
    return owner


class _Links:
    """``Topology.bandwidth`` from any owner to a node, as arrays over the tables' ranks.

    Rule 2's answer depends only on the owners and the needer's node, and for a node that
    holds none of the owners only on its NIC's bandwidth: it is computed once per owner set
    and node (``of``), at 4096 ranks a few thousand times for a million (slice, needer) pairs.
    """

    def __init__(self, tables: Sequence[BsrTable], topology: Topology) -> None:
        owners = sorted({r for t in tables for e in t.entries for r in e.owners})
        self.num_ranks = 1 + max(owners, default=0)
        self.flat = not topology.nodes
        self.node = np.full(self.num_ranks, -1, dtype=np.int64)
        self._by_owners: dict[tuple[int, ...], _Fastest] = {}
        if self.flat:
            return
        for r in owners:
            self.node[r] = topology.node_of(r)  # TopologyError for a rank on no node
        self.intra = np.array([n.intra.bandwidth for n in topology.nodes])
        self.nic = np.array([n.nic.bandwidth for n in topology.nodes])

    def of(self, owners: tuple[int, ...]) -> _Fastest:
        """``owners``' answers to rule 2, by needer's node (filled as nodes are asked)."""
        out = self._by_owners.get(owners)
        if out is None:
            out = self._by_owners[owners] = _Fastest(self, owners)
        return out

    def fastest(self, owners: tuple[int, ...], home: int) -> np.ndarray:
        """The owners on the fastest link to a rank of node ``home`` (rule 2), in rank
        order, so that the first minimum of their loads is the lowest rank (rule 4)."""
        ranks = np.array(sorted(owners), dtype=np.int64)
        if self.flat:
            return ranks
        nodes = self.node[ranks]
        bandwidth = np.where(
            nodes == home, self.intra[home], np.minimum(self.nic[nodes], self.nic[home])
        )
        return ranks[bandwidth == bandwidth.max()]


Candidates = tuple[int, ...]
"""Owners on the fastest link, in rank order."""


class _Fastest(dict[int, Candidates]):
    """Rule 2 for one owner set: needer's node -> its candidates (``_Links.fastest``)."""

    def __init__(self, links: _Links, owners: tuple[int, ...]) -> None:
        super().__init__()
        self.links, self.owners = links, owners
        self.homes = set() if links.flat else {int(n) for n in links.node[list(owners)]}
        self.far: dict[float, Candidates] = {}  # a node holding no owner: by its NIC

    def __missing__(self, home: int) -> Candidates:
        links = self.links
        if home in self.homes or links.flat:
            out = self[home] = _candidates(links.fastest(self.owners, home))
            return out
        nic = float(links.nic[home])
        far = self.far.get(nic)
        if far is None:
            far = self.far[nic] = _candidates(links.fastest(self.owners, home))
        self[home] = far
        return far


def _candidates(ranks: np.ndarray) -> Candidates:
    return tuple(int(r) for r in ranks)


def bsr_step(
    transfers: tuple[Transfer, ...], *, before: Annotation, after: Annotation, shape: Sequence[int]
) -> BatchedSendRecv | Local:
    """The step that runs ``transfers`` from layout ``before`` to ``after``, leaving out what
    moves nothing: a rank whose only transfer copies its whole piece, unchanged, is left
    out (it keeps its tensor), and when no transfer is left between two ranks the step is a
    local slice, not a BSR.

    >>> from hspmd.annotation import parse_annotation as A
    >>> bsr_step((Transfer(0, 0, ((0, 2),)),), before=A("hD: [0]{} [1]{}"), after=A("[0]{}"),
    ...          shape=(2,))
    Local(keep=(), zero=())
    """
    by_rank: dict[int, list[Transfer]] = defaultdict(list)
    for t in transfers:
        by_rank[t.src].append(t)
        if t.dst != t.src:
            by_rank[t.dst].append(t)
    idle = {r for r, ts in by_rank.items() if _unchanged(r, ts, before, after, shape)}
    kept = tuple(t for t in transfers if t.dst not in idle)
    if all(t.src == t.dst for t in kept):
        return Local(tuple(sorted({t.dst for t in kept})))
    return BatchedSendRecv(kept)


def _unchanged(
    rank: int, ts: list[Transfer], before: Annotation, after: Annotation, shape: Sequence[int]
) -> bool:
    """``rank``'s only transfer copies its piece, the same region before and after."""
    if len(ts) != 1 or ts[0].src != ts[0].dst or rank not in before or rank not in after:
        return False
    region = before.piece(rank, shape).region
    return region == after.piece(rank, shape).region == ts[0].region


def messages(transfers: Sequence[Transfer]) -> dict[tuple[int, int], tuple[Transfer, ...]]:
    """Fused BSR sends one message per (sender, receiver) pair; local copies are not messages."""
    out: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        if t.src != t.dst:
            out[(t.src, t.dst)].append(t)
    return {pair: tuple(ts) for pair, ts in sorted(out.items())}
