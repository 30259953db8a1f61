"""Communication plans: the printable data a reshard resolves into.

A ``CommPlan`` is a sequence of steps with the layout (an ``Annotation``) the tensor has
before each step; ``layouts[i]`` is the layout before ``steps[i]`` and ``layouts[-1]`` is the
destination. Every rank's local tensor is, at each point, its ``Piece`` of the current
layout (``Annotation.piece``). Steps name global regions; an executor turns a global region
into local coordinates by subtracting the start of the rank's own piece (``local_box``).

Step kinds and what each does to the local tensors of the ranks it names:

    kind            tier    effect
    identity        -       nothing (src == dst)
    send-recv       bottom  dst's tensor := src's tensor, per pair
    all-reduce      bottom  sum over each group
    reduce-scatter  bottom  sum over the group, then chunk ``dim`` evenly, member i keeps i
    all-gather      bottom  concatenate along ``dim`` in group order
    all-to-all      bottom  chunk ``split_dim``, send chunk j to member j, concat ``concat_dim``
    local           -       new piece := old piece cut or zero-padded to the new region;
                            ranks in ``zero`` take zeros (a partial summand that is not theirs)
    split-all-reduce   top  per slice: sum ``region`` over ``ranks`` (``zero`` add nothing)
    split-reduce-scatter top per slice: sum ``region`` over ``ranks`` into ``root``'s new piece
    split-all-gather   top  per slice: every rank of ``ranks`` gets ``region`` from ``owners``
    bsr             -       batched send/receive: each new piece is assembled from transfers
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hspmd.annotation import Annotation, Piece, Region

Group = tuple[int, ...]


def region_text(region: Region) -> str:
    """``((0, 4), (0, 12))`` -> ``[0:4,0:12]``."""
    return "[" + ",".join(f"{a}:{b}" for a, b in region) + "]"


def intersect(a: Region, b: Region) -> Region | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return box if all(lo < hi for lo, hi in box) else None


def local_box(piece: Piece, region: Region) -> tuple[slice, ...]:
    """Index of global ``region`` inside the local tensor of ``piece``."""
    return tuple(
        slice(r0 - p0, r1 - p0) for (r0, r1), (p0, _) in zip(region, piece.region, strict=True)
    )


def volume(region: Region) -> int:
    out = 1
    for lo, hi in region:
        out *= hi - lo
    return out


class Step:
    """Base of every step: a kind, the ranks it touches, a one-line text per rank."""

    __slots__ = ()
    kind: ClassVar[str]
    tier: ClassVar[str] = ""

    @property
    def ranks(self) -> frozenset[int]:
        raise NotImplementedError

    def describe(self, rank: int) -> str:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError


def _group_of(groups: tuple[Group, ...], rank: int) -> Group:
    return next(g for g in groups if rank in g)


def _groups_text(group: Group) -> str:
    return "[" + ",".join(map(str, group)) + "]"


@dataclass(frozen=True, slots=True)
class GroupCollective(Step):
    """All-reduce, reduce-scatter, all-gather or all-to-all within disjoint groups."""

    groups: tuple[Group, ...]

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(r for g in self.groups for r in g)

    def _args(self) -> str:
        return ""

    def describe(self, rank: int) -> str:
        return f"{self.kind} group={_groups_text(_group_of(self.groups, rank))}{self._args()}"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind, "groups": [list(g) for g in self.groups]}
        for name in ("dim", "split_dim", "concat_dim"):
            if hasattr(self, name):
                data[name] = getattr(self, name)
        return data


@dataclass(frozen=True, slots=True)
class AllReduce(GroupCollective):
    kind: ClassVar[str] = "all-reduce"
    tier: ClassVar[str] = "bottom"


@dataclass(frozen=True, slots=True)
class ReduceScatter(GroupCollective):
    dim: int = 0
    kind: ClassVar[str] = "reduce-scatter"
    tier: ClassVar[str] = "bottom"

    def _args(self) -> str:
        return f" dim={self.dim}"


@dataclass(frozen=True, slots=True)
class AllGather(GroupCollective):
    dim: int = 0
    kind: ClassVar[str] = "all-gather"
    tier: ClassVar[str] = "bottom"

    def _args(self) -> str:
        return f" dim={self.dim}"


@dataclass(frozen=True, slots=True)
class AllToAll(GroupCollective):
    split_dim: int = 0
    concat_dim: int = 0
    kind: ClassVar[str] = "all-to-all"
    tier: ClassVar[str] = "bottom"

    def _args(self) -> str:
        return f" split_dim={self.split_dim} concat_dim={self.concat_dim}"


@dataclass(frozen=True, slots=True)
class SendRecv(Step):
    """Whole local tensors move ``src -> dst`` (same DS, different DG)."""

    pairs: tuple[tuple[int, int], ...]
    kind: ClassVar[str] = "send-recv"
    tier: ClassVar[str] = "bottom"

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(r for p in self.pairs for r in p)

    def describe(self, rank: int) -> str:
        parts = [f"send to {d}" for s, d in self.pairs if s == rank]
        parts += [f"recv from {s}" for s, d in self.pairs if d == rank]
        return f"{self.kind} " + ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "pairs": [list(p) for p in self.pairs]}


@dataclass(frozen=True, slots=True)
class Local(Step):
    """No communication: cut (or zero-pad) each piece to its new region; ``zero`` get zeros."""

    keep: tuple[int, ...]
    zero: tuple[int, ...] = ()
    kind: ClassVar[str] = "local"

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(self.keep) | frozenset(self.zero)

    def describe(self, rank: int) -> str:
        return f"{self.kind} " + ("zeros" if rank in self.zero else "slice")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "keep": list(self.keep), "zero": list(self.zero)}


@dataclass(frozen=True, slots=True)
class SliceReduce:
    """One finest slice of a split collective.

    ``ranks`` take part; ``zero`` (a subset) contribute zeros; ``root`` (split-reduce-scatter
    only) receives the sum; ``owners`` (split-all-gather only) hold the sub-regions the
    others receive.
    """

    region: Region
    ranks: Group
    zero: Group = ()
    root: int = -1
    owners: tuple[tuple[int, Region], ...] = ()

    def text(self) -> str:
        out = f"{region_text(self.region)} over {_groups_text(self.ranks)}"
        if self.root >= 0:
            out += f" to {self.root}"
        if self.zero:
            out += f" zeros={_groups_text(self.zero)}"
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "region": [list(r) for r in self.region],
            "ranks": list(self.ranks),
            "zero": list(self.zero),
            "root": self.root,
            "owners": [[r, [list(x) for x in reg]] for r, reg in self.owners],
        }


@dataclass(frozen=True, slots=True)
class SliceCollective(Step):
    """Split-all-reduce, split-reduce-scatter or split-all-gather: one collective per slice."""

    slices: tuple[SliceReduce, ...]

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(r for s in self.slices for r in s.ranks)

    def describe(self, rank: int) -> str:
        mine = [s.text() for s in self.slices if rank in s.ranks]
        return f"{self.kind} " + "; ".join(mine)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "slices": [s.to_json() for s in self.slices]}


@dataclass(frozen=True, slots=True)
class SplitAllReduce(SliceCollective):
    kind: ClassVar[str] = "split-all-reduce"
    tier: ClassVar[str] = "top"


@dataclass(frozen=True, slots=True)
class SplitReduceScatter(SliceCollective):
    kind: ClassVar[str] = "split-reduce-scatter"
    tier: ClassVar[str] = "top"


@dataclass(frozen=True, slots=True)
class SplitAllGather(SliceCollective):
    kind: ClassVar[str] = "split-all-gather"
    tier: ClassVar[str] = "top"


@dataclass(frozen=True, slots=True)
class Transfer:
    """Region ``region`` of tensor ``tensor`` goes ``src -> dst`` (``src == dst``: local copy)."""

    src: int
    dst: int
    region: Region
    tensor: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "region": [list(r) for r in self.region],
            "tensor": self.tensor,
        }


@dataclass(frozen=True, slots=True)
class BatchedSendRecv(Step):
    """Batched send/receive: every destination piece is assembled from ``transfers``."""

    transfers: tuple[Transfer, ...]
    kind: ClassVar[str] = "bsr"

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(r for t in self.transfers for r in (t.src, t.dst))

    def describe(self, rank: int) -> str:
        copies = sum(1 for t in self.transfers if t.src == t.dst == rank)
        sends = sorted({t.dst for t in self.transfers if t.src == rank and t.dst != rank})
        recvs = sorted({t.src for t in self.transfers if t.dst == rank and t.src != rank})
        return f"{self.kind} copy={copies} send_to={sends} recv_from={recvs}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "transfers": [t.to_json() for t in self.transfers]}


#: the step kinds the runtime issues without waiting (``hspmd.runtime.execute``'s issuers)
ASYNC_KINDS = frozenset(
    {"all-reduce", "reduce-scatter", "split-all-reduce", "split-reduce-scatter"}
)


def startable(plan: CommPlan) -> bool:
    """Whether the runtime's ``start_plan`` returns without blocking on every rank: every
    step but the last is local, and the last is local or of ``ASYNC_KINDS`` (so Post may
    issue it inside a backward hook, ``hspmd.train.overlap``)."""
    steps = plan.steps
    return all(isinstance(s, Local) for s in steps[:-1]) and (
        not steps or isinstance(steps[-1], Local) or steps[-1].kind in ASYNC_KINDS
    )


@dataclass(frozen=True, slots=True)
class CommPlan:
    """A resolved reshard of a tensor of global ``shape`` from ``src`` to ``dst``."""

    src: Annotation
    dst: Annotation
    shape: tuple[int, ...]
    steps: tuple[Step, ...]
    layouts: tuple[Annotation, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.layouts:
            object.__setattr__(self, "layouts", (self.src,) * len(self.steps) + (self.dst,))
        assert len(self.layouts) == len(self.steps) + 1, "one layout before each step, and dst"
        assert self.layouts[0] == self.src and self.layouts[-1] == self.dst

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.steps) or ("identity",)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src.ranks) | set(self.dst.ranks)))

    def for_rank(self, rank: int) -> Iterator[tuple[int, Step]]:
        """The steps ``rank`` takes part in, with their index."""
        for index, step in enumerate(self.steps):
            if rank in step.ranks:
                yield index, step

    def to_json(self) -> dict[str, Any]:
        return {
            "src": str(self.src),
            "dst": str(self.dst),
            "shape": list(self.shape),
            "steps": [
                {**s.to_json(), "layout_after": str(self.layouts[i + 1])}
                for i, s in enumerate(self.steps)
            ],
        }

    def __str__(self) -> str:
        lines = [f"reshard {self.src} -> {self.dst} shape={list(self.shape)}"]
        if not self.steps:
            lines.append("  identity")
        for rank in self.ranks:
            src = self.src.piece(rank, self.shape) if rank in self.src else None
            dst = self.dst.piece(rank, self.shape) if rank in self.dst else None
            lines.append(
                f"  rank {rank}: {region_text(src.region) if src else '-'} -> "
                f"{region_text(dst.region) if dst else '-'}"
            )
            for index, step in self.for_rank(rank):
                lines.append(f"    {index}: {step.describe(rank)}")
        return "\n".join(lines)
