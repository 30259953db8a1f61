"""Bottom-tier resolution: each subgroup changes on its own; subgroups share steps.

Per subgroup (Figure 7, bottom tier):

- DS and DG equal: nothing; DS equal, DG differs: send-recv position-wise;
- DG equal, DS with the same degrees in the same order: one collective per changed axis,
  as DTensor does per mesh dim::

      from \\ to   D                P                split k
      P           all-reduce       -                reduce-scatter (k free)
      split j     all-gather       local (zero-pad) all-to-all (k free)
      D           -                local (zeros)    local (slice, k free)

  taken reduce first, gathers and all-to-alls next, local last, so that every
  intermediate DS is valid (a dim is split by at most one axis, or by adjacent axes,
  which are one split);
- DG equal, degrees differ but refine to a common list (``{2:2,1:2} -> {2:4}`` is
  ``(2,2),(1,2) -> (2,2),(2,2)``): the same collectives on the refined axes (here one
  all-to-all over the second axis: context parallelism's heads split);
- otherwise BSR: all-reduce the source partial axis first, BSR to the destination with
  its partial axis duplicated, then a local step zeroing the non-first summands.

``merge_moves`` then puts the moves of all subgroups into steps: one step per kind, with the
groups of every subgroup that takes it (one all-gather over ``(0,1),(2,3)``, not two).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hspmd.annotation import DUP, PARTIAL, Annotation, Region
from hspmd.comm.axes import Axes, Group, common_refinement
from hspmd.comm.bsr import BsrTable, bsr_step, schedule
from hspmd.comm.plan import (
    AllGather,
    AllReduce,
    AllToAll,
    Local,
    ReduceScatter,
    SendRecv,
    Step,
    Transfer,
)
from hspmd.comm.topology import Topology
from hspmd.errors import AnnotationError

PHASE = {
    "all-reduce": 0,
    "reduce-scatter": 0,
    "all-gather": 1,
    "all-to-all": 1,
    "send-recv": 2,
    "bsr": 2,
    "local": 3,
}


@dataclass(frozen=True, slots=True)
class Move:
    """One subgroup's share of a step: ``key`` names the step (kind and dims)."""

    key: tuple[str, ...] | tuple[str, int] | tuple[str, int, int]
    after: Axes
    groups: tuple[Group, ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()
    table: BsrTable | None = None
    zero: tuple[int, ...] = ()

    @property
    def kind(self) -> str:
        return str(self.key[0])


def subgroup_moves(src: Axes, dst: Axes, *, part: Region, shape: Sequence[int]) -> list[Move]:
    """The moves taking one subgroup from ``src`` to ``dst`` (``part``: its top-tier region)."""
    if src == dst:
        return []
    if src.entries == dst.entries and len(src.ranks) == len(dst.ranks):
        pairs = tuple((a, b) for a, b in zip(src.ranks, dst.ranks, strict=True) if a != b)
        return [Move(("send-recv",), dst, pairs=pairs)]
    if src.ranks == dst.ranks and src.degrees == dst.degrees:
        moves = collective_moves(src, dst)
        if moves is not None:
            return moves
    elif src.ranks == dst.ranks:  # e.g. {2:2,1:2} -> {2:4}: axes (2,2),(1,2) -> (2,2),(2,2)
        degrees = common_refinement(src.degrees, dst.degrees)
        if degrees is not None:
            fine_src, fine_dst = src.refined(degrees), dst.refined(degrees)
            moves = collective_moves(fine_src, fine_dst, nested=True)
            if moves is not None:
                return moves
    return bsr_moves(src, dst, part=part, shape=shape)


def _free_nested(cur: Axes, axis: int, dim: int) -> bool:
    """True if a step may split ``dim`` on ``axis`` by cutting the local tensor: no other
    axis splits it, or only the axes right before ``axis`` (the new cut is then the
    innermost one of that dim, and the adjacent splits merge: ``Axes.merged_splits``)."""
    users = [a for a, d in enumerate(cur.dims()) if d == dim and a != axis]
    return users == list(range(axis - len(users), axis))


def _innermost(cur: Axes, axis: int, dim: int) -> bool:
    """True if no axis after ``axis`` splits ``dim``: gathering ``dim`` over ``axis`` then
    concatenates contiguous blocks."""
    return all(d != dim for d in cur.dims()[axis + 1 :])


def _next_transition(cur: Axes, dst: Axes, nested: bool) -> tuple[int, int, tuple] | None:
    """``(priority, axis, key)`` of the first applicable per-axis transition; ``nested``:
    a dim may be split by adjacent axes (refined layouts), else by one axis only."""

    def _free(cur: Axes, axis: int, dim: int) -> bool:
        return _free_nested(cur, axis, dim) if nested else dim not in cur.dims()

    best = None
    for axis, ((a, _), (b, _)) in enumerate(zip(cur.entries, dst.entries, strict=True)):
        if a == b:
            continue
        key: tuple | None = None
        if a == PARTIAL and b == DUP:
            key = (0, ("all-reduce",))
        elif a == PARTIAL and b >= 0 and _free(cur, axis, b):
            key = (1, ("reduce-scatter", b))
        elif a >= 0 and b == DUP and _innermost(cur, axis, a):
            key = (2, ("all-gather", a))
        elif a >= 0 and b >= 0 and _innermost(cur, axis, a) and _free(cur, axis, b):
            key = (3, ("all-to-all", b, a))
        elif (b == PARTIAL and (a < 0 or _innermost(cur, axis, a))) or (
            a == DUP and b >= 0 and _free(cur, axis, b)
        ):
            key = (4, ("local",))
        if key is not None and (best is None or key[0] < best[0]):
            best = (key[0], axis, key[1])
    return best


def collective_moves(src: Axes, dst: Axes, *, nested: bool = False) -> list[Move] | None:
    """Per-axis collectives from ``src`` to ``dst`` (same DG, same degrees), or None.
    ``nested``: the axes are refined (``Axes.refined``), so a dim may be split by adjacent
    axes; a step may then cut a dim only as its innermost split, and gather one only
    from its innermost split."""
    moves: list[Move] = []
    cur = src
    while cur != dst:
        found = _next_transition(cur, dst, nested)
        if found is None:
            return None
        _, axis, key = found
        after = cur.replace(axis, dst.entries[axis][0])
        if key[0] == "local":
            zero = cur.nonzero_on(axis) if cur.entries[axis][0] == DUP else ()
            if dst.entries[axis][0] != PARTIAL:
                zero = ()
            if moves and moves[-1].kind == "local":
                zero = tuple(sorted(set(moves[-1].zero) | set(zero)))
                moves[-1] = replace(moves[-1], after=after, zero=zero)
            else:
                moves.append(Move(key, after, zero=zero))
        else:
            moves.append(Move(key, after, groups=cur.groups(axis)))
        cur = after
    return moves


def bsr_moves(src: Axes, dst: Axes, *, part: Region, shape: Sequence[int]) -> list[Move]:
    """All-reduce source partials, BSR (or send-recv), then zero non-first summands."""
    moves: list[Move] = []
    cur = src
    for axis, (dim, _) in enumerate(src.entries):
        if dim == PARTIAL:
            after = cur.replace(axis, DUP)
            moves.append(Move(("all-reduce",), after, groups=cur.groups(axis)))
            cur = after
    target = dst.without_partial()
    if cur.entries == target.entries and len(cur.ranks) == len(target.ranks):
        pairs = tuple((a, b) for a, b in zip(cur.ranks, target.ranks, strict=True) if a != b)
        if pairs:
            moves.append(Move(("send-recv",), target, pairs=pairs))
    elif cur.regions(part) != target.regions(part) or cur.ranks != target.ranks:
        table = BsrTable.of(cur.regions(part), target.regions(part), shape)
        moves.append(Move(("bsr",), target, table=table))
    if target != dst:
        moves.append(Move(("local",), dst, zero=dst.partial_zeros()))
    return moves


Layout = Callable[[Sequence[Axes]], Annotation]


def merge_moves(
    moves: Sequence[list[Move]],
    start: Sequence[Axes],
    *,
    make_layout: Layout,
    parts: Sequence[Region],
    shape: Sequence[int],
    topology: Topology | None,
) -> tuple[list[Step], list[Annotation]]:
    """Steps and the layout after each, taking the subgroups' moves phase by phase."""
    state = list(start)
    position = [0] * len(moves)
    steps: list[Step] = []
    layouts: list[Annotation] = []
    while True:
        ready = {s: m[position[s]] for s, m in enumerate(moves) if position[s] < len(m)}
        if not ready:
            return steps, layouts
        best = min(ready.values(), key=lambda m: (PHASE[m.kind], m.key))
        if PHASE[best.kind] == 2:
            chosen = {s: m for s, m in ready.items() if PHASE[m.kind] == 2}
            new_steps = _movement(chosen, state, make_layout, parts, shape, topology)
        else:
            chosen = {s: m for s, m in ready.items() if m.key == best.key}
            new_steps = [(_step(best.key, list(chosen.values()), state, chosen), chosen)]
        for step, done in new_steps:
            for s, move in done.items():
                state[s] = move.after
                position[s] += 1
            steps.append(step)
            layouts.append(make_layout(state))


def _step(key: tuple, chosen: list[Move], state: list[Axes], by_subgroup: dict[int, Move]) -> Step:
    groups = tuple(g for m in chosen for g in m.groups)
    kind = key[0]
    if kind == "all-reduce":
        return AllReduce(groups)
    if kind == "reduce-scatter":
        return ReduceScatter(groups, dim=key[1])
    if kind == "all-gather":
        return AllGather(groups, dim=key[1])
    if kind == "all-to-all":
        return AllToAll(groups, split_dim=key[1], concat_dim=key[2])
    assert kind == "local", kind
    zero = tuple(sorted(r for m in chosen for r in m.zero))
    ranks = sorted(
        r for s, m in by_subgroup.items() for r in set(state[s].ranks) | set(m.after.ranks)
    )
    return Local(tuple(r for r in ranks if r not in zero), zero)


def _movement(
    chosen: dict[int, Move],
    state: list[Axes],
    make_layout: Layout,
    parts: Sequence[Region],
    shape: Sequence[int],
    topology: Topology | None,
) -> list[tuple[Step, dict[int, Move]]]:
    """Send-recv and BSR moves: one step each, or one BSR if a send-recv step first would
    leave two subgroups on the same rank."""
    sends = {s: m for s, m in chosen.items() if m.kind == "send-recv"}
    bsrs = {s: m for s, m in chosen.items() if m.kind == "bsr"}
    if sends and bsrs:
        trial = list(state)
        for s, m in sends.items():
            trial[s] = m.after
        try:
            make_layout(trial)
        except AnnotationError:
            # Position-wise transfers, not a BSR table: a table keeps regions only and
            # would lose which partial summand each rank holds.
            moved = [t for s, m in sends.items() for t in _position_wise(state[s], m, parts[s])]
            bsrs.update({s: replace(m, key=("bsr",)) for s, m in sends.items()})
            sends = {}
            return _bsr(bsrs, moved, state, make_layout, shape, topology)
    out: list[tuple[Step, dict[int, Move]]] = []
    if sends:
        pairs = tuple(p for m in sends.values() for p in m.pairs)
        out.append((SendRecv(pairs), sends))
    if bsrs:
        before = list(state)
        for s, m in sends.items():
            before[s] = m.after
        out.extend(_bsr(bsrs, [], before, make_layout, shape, topology))
    return out


def _bsr(
    bsrs: dict[int, Move],
    moved: list[Transfer],
    before: list[Axes],
    make_layout: Layout,
    shape: Sequence[int],
    topology: Topology | None,
) -> list[tuple[Step, dict[int, Move]]]:
    """One BSR step: the tables of ``bsrs`` scheduled, plus the explicit ``moved``."""
    tables = [m.table for m in bsrs.values() if m.table is not None]
    after = list(before)
    for s, m in bsrs.items():
        after[s] = m.after
    step = bsr_step(
        (*schedule(tables, topology=topology), *moved),
        before=make_layout(before),
        after=make_layout(after),
        shape=shape,
    )
    return [(step, bsrs)]


def _position_wise(src: Axes, move: Move, part: Region) -> list[Transfer]:
    """A send-recv move as transfers: the i-th rank's piece goes to the i-th rank after."""
    regions = src.regions(part)
    return [Transfer(a, b, regions[a]) for a, b in zip(src.ranks, move.after.ranks, strict=True)]
