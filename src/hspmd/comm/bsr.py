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

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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


Chooser = Callable[[BsrEntry, int, dict[int, float]], int]


def _heuristic(topology: Topology) -> Chooser:
    """Rules 2-4 of the module docstring. The bandwidth of a pair is ``Topology.bandwidth``,
    inlined: a switch at 512 ranks asks it 1.6 million times."""
    if not topology.nodes:  # one link class: rules 3 and 4 only
        return lambda entry, needer, loads: min(entry.owners, key=lambda o: (loads.get(o, 0.0), o))
    node_of = topology.node_of
    intra = [n.intra.bandwidth for n in topology.nodes]
    nic = [n.nic.bandwidth for n in topology.nodes]

    def choose(entry: BsrEntry, needer: int, loads: dict[int, float]) -> int:
        home = node_of(needer)

        def key(owner: int) -> tuple[float, float, int]:
            node = node_of(owner)
            bandwidth = intra[node] if node == home else min(nic[node], nic[home])
            return (-bandwidth, loads.get(owner, 0.0), owner)

        return min(entry.owners, key=key)

    return choose


def _naive(entry: BsrEntry, needer: int, loads: dict[int, float]) -> int:
    return entry.owners[0]


def schedule(
    tables: Sequence[BsrTable],
    *,
    topology: Topology | None = None,
    method: str = "heuristic",
    fused: bool = True,
) -> tuple[Transfer, ...]:
    """Transfers serving every (slice, needer) of ``tables``, merged into boxes per pair.

    >>> from hspmd.annotation import parse_annotation as A
    >>> t = BsrTable.between(A("[0,1]{D:2}"), A("[2,3]{0:2}"), (4,))
    >>> [(x.src, x.dst, x.region) for x in schedule([t])]
    [(0, 2, ((0, 2),)), (1, 3, ((2, 4),))]
    """
    if method not in METHODS:
        raise ResolutionError(f"unknown BSR method {method!r}: use one of {', '.join(METHODS)}")
    choose = _naive if method == "naive" else _heuristic(topology or Topology.flat())
    loads: dict[int, float] = {}
    picked: dict[tuple[int, int, int], list[Region]] = defaultdict(list)
    for table in tables:
        if not fused:
            loads = {}
        for entry in table.entries:
            size = volume(entry.region) * table.itemsize
            for needer in entry.needers:
                if needer in entry.owners:
                    picked[(needer, needer, table.tensor)].append(entry.region)
                    continue
                owner = choose(entry, needer, loads)
                loads[owner] = loads.get(owner, 0.0) + size
                picked[(owner, needer, table.tensor)].append(entry.region)
    return tuple(
        Transfer(src, dst, box, tensor)
        for (src, dst, tensor), boxes in sorted(picked.items())
        for box in merge_boxes(boxes)
    )


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
