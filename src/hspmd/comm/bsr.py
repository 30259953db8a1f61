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
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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

    The heuristic's rule 2 depends only on the needer's node, so each slice's fastest owners
    are found once per needing node; rules 3 and 4 are then one ``argmin`` over their loads
    (owners in rank order: the first minimum is the lowest rank). At 4096 ranks a slice has
    hundreds of owners and the switch hundreds of thousands of (slice, needer) pairs.

    >>> from hspmd.annotation import parse_annotation as A
    >>> t = BsrTable.between(A("[0,1]{D:2}"), A("[2,3]{0:2}"), (4,))
    >>> [(x.src, x.dst, x.region) for x in schedule([t])]
    [(0, 2, ((0, 2),)), (1, 3, ((2, 4),))]
    """
    if method not in METHODS:
        raise ResolutionError(f"unknown BSR method {method!r}: use one of {', '.join(METHODS)}")
    topology = topology or Topology.flat()
    node = functools.cache(topology.node_of)  # TopologyError for a rank on no node
    links = _Links(tables, topology) if method == "heuristic" else None
    loads = np.zeros(links.num_ranks if links else 0)
    picked: dict[tuple[int, int, int], list[Region]] = defaultdict(list)
    for table in tables:
        if not fused:
            loads[:] = 0.0
        for entry in table.entries:
            size = volume(entry.region) * table.itemsize
            fastest: dict[int, np.ndarray] = {}  # needer's node -> owners on its fastest link
            for needer in entry.needers:
                if needer in entry.owners:
                    picked[(needer, needer, table.tensor)].append(entry.region)
                    continue
                if links is None:
                    owner = entry.owners[0]
                else:
                    home = node(needer)
                    if home not in fastest:
                        fastest[home] = links.fastest(entry.owners, home)
                    owners = fastest[home]
                    owner = int(owners[0] if len(owners) == 1 else owners[loads[owners].argmin()])
                    loads[owner] += size
                picked[(owner, needer, table.tensor)].append(entry.region)
    return tuple(
        Transfer(src, dst, box, tensor)
        for (src, dst, tensor), boxes in sorted(picked.items())
        for box in merge_boxes(boxes)
    )


class _Links:
    """``Topology.bandwidth`` from any owner to a node, as arrays over the tables' ranks."""

    def __init__(self, tables: Sequence[BsrTable], topology: Topology) -> None:
        owners = sorted({r for t in tables for e in t.entries for r in e.owners})
        self.num_ranks = 1 + max(owners, default=0)
        self.flat = not topology.nodes
        self.node = np.full(self.num_ranks, -1, dtype=np.int64)
        if self.flat:
            return
        for r in owners:
            self.node[r] = topology.node_of(r)  # TopologyError for a rank on no node
        self.intra = np.array([n.intra.bandwidth for n in topology.nodes])
        self.nic = np.array([n.nic.bandwidth for n in topology.nodes])

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
