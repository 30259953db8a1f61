"""HSPMD annotations: device groups, distributed states, and the two-tier annotation.

Vocabulary (DESIGN.md): a *device group* (DG) is an ordered list of ranks; *distributed
states* (DS) map tensor dims to degrees (``dim >= 0`` split, ``-1`` duplicate, ``-2``
partial) in an order that numbers the devices, the last entry varying fastest; an
*annotation* is a union of ``hsize`` (DG, DS) subgroups plus ``hdim``, how the tensor is
divided among the subgroups.

Text forms (round-trip exactly through ``parse_ds`` / ``parse_annotation``)::

    {0:2,D:2}                         split dim 0 two ways, duplicate two ways
    [0,1,2,3]{0:2,D:2}                one subgroup (hsize 1)
    h0: [0,1,2,3]{0:2,D:2} [4,5]{D:2} dim 0 cut evenly between two subgroups
    h0(6,2): [0,1]{D:2} [2]{}         dim 0 cut into parts of 6 and 2
    hD: ... / hP: ...                 duplicate / partial across subgroups

Which block a rank holds: a rank at position ``i`` of its subgroup's DG takes one index per
DS entry by mixed radix over the DS order (last entry fastest). ``{0:2,D:2}`` on
``[0,1,2,3]``::

    rank  index(0:2)  index(D:2)  holds rows
    0     0           0           first half
    1     0           1           first half (copy)
    2     1           0           second half
    3     1           1           second half (copy)
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hspmd.errors import AnnotationError

DUP = -1
PARTIAL = -2

Region = tuple[tuple[int, int], ...]
"""A box of a global tensor: one half-open ``(start, stop)`` per dim."""


def _dim_text(dim: int) -> str:
    return {DUP: "D", PARTIAL: "P"}.get(dim, str(dim))


def _parse_dim(text: str) -> int:
    text = text.strip()
    if text in ("D", "d", "-1"):
        return DUP
    if text in ("P", "p", "-2"):
        return PARTIAL
    if not text.isdigit():
        raise AnnotationError(
            f"bad DS key {text!r}: use a tensor dim (0, 1, ...), D (duplicate) or P (partial)"
        )
    return int(text)


@dataclass(frozen=True, slots=True)
class DeviceGroup:
    """An ordered list of distinct ranks. Text form: ``[0,1,2,3]``."""

    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise AnnotationError("empty device group []: list at least one rank")
        if any(r < 0 for r in self.ranks):
            raise AnnotationError(f"negative rank in device group {list(self.ranks)}")
        if len(set(self.ranks)) != len(self.ranks):
            raise AnnotationError(f"rank listed twice in device group {list(self.ranks)}")

    def __len__(self) -> int:
        return len(self.ranks)

    def __str__(self) -> str:
        return "[" + ",".join(map(str, self.ranks)) + "]"


@dataclass(frozen=True, slots=True)
class DistributedStates:
    """Ordered ``(dim, degree)`` entries; listed order is the device order.

    >>> str(DistributedStates.of((0, 2), (-1, 2)))
    '{0:2,D:2}'
    >>> DistributedStates.of((0, 2), (-1, 2)).num_devices
    4

    Entries of degree 1 are dropped, so ``{0:1}`` and ``{}`` are the same value.
    """

    entries: tuple[tuple[int, int], ...]

    @staticmethod
    def of(*entries: tuple[int, int]) -> DistributedStates:
        return DistributedStates(tuple(entries))

    def __post_init__(self) -> None:
        cleaned = tuple((int(d), int(n)) for d, n in self.entries if int(n) != 1)
        dims = [d for d, _ in cleaned]
        if len(set(dims)) != len(dims):
            raise AnnotationError(f"DS {self._text(cleaned)} lists a dim twice: merge the degrees")
        for dim, degree in cleaned:
            if dim < PARTIAL:
                raise AnnotationError(f"bad DS dim {dim}: use >= 0, -1 (D) or -2 (P)")
            if degree < 1:
                raise AnnotationError(f"bad degree {degree} for dim {_dim_text(dim)}: use >= 1")
        object.__setattr__(self, "entries", cleaned)

    @property
    def num_devices(self) -> int:
        return math.prod(n for _, n in self.entries)

    def degree(self, dim: int) -> int:
        return next((n for d, n in self.entries if d == dim), 1)

    def indices(self, position: int) -> tuple[int, ...]:
        """Per-entry indices of the device at ``position``, by mixed radix (last fastest)."""
        out = []
        for _, degree in reversed(self.entries):
            out.append(position % degree)
            position //= degree
        return tuple(reversed(out))

    def position(self, indices: Sequence[int]) -> int:
        """Inverse of ``indices``."""
        position = 0
        for (_, degree), index in zip(self.entries, indices, strict=True):
            position = position * degree + index
        return position

    @staticmethod
    def _text(entries: Iterable[tuple[int, int]]) -> str:
        return "{" + ",".join(f"{_dim_text(d)}:{n}" for d, n in entries) + "}"

    def __str__(self) -> str:
        return self._text(self.entries)


@dataclass(frozen=True, slots=True)
class Piece:
    """What one rank holds: a region, and which summand of a partial sum it is.

    ``partial`` has one index per partial entry (top tier first); ranks whose pieces share
    ``region`` and ``partial`` are copies, and the global value of ``region`` is the sum over
    the distinct ``partial`` indices.
    """

    region: Region
    partial: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.region)


@dataclass(frozen=True, slots=True)
class Annotation:
    """The two-tier HSPMD annotation: subgroups ``zip(groups, states)`` and ``hdim``.

    ``hsizes`` gives uneven top-tier part sizes along ``hdim >= 0`` (None: even).
    With one subgroup, ``hdim`` is normalized to duplicate.
    """

    groups: tuple[DeviceGroup, ...]
    states: tuple[DistributedStates, ...]
    hdim: int = DUP
    hsizes: tuple[int, ...] | None = None
    # Hashed once: annotations key every cache of the geometry and of resolution, and one
    # over 4096 ranks would otherwise rehash thousands of nested tuples per lookup.
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    # shape -> every rank's piece, on the object itself: equal annotations built apart
    # (a plan's layouts) would otherwise be compared element by element in every lookup of
    # the module cache. Read-only once filled (``pieces`` hands out copies).
    _memo: dict[tuple[int, ...], dict[int, Piece]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # rank -> (subgroup, position), on the object for the same reason (filled on first use;
    # 65,536 ranks: a module cache compared 8,192 groups per membership test)
    _index: dict[int, tuple[int, int]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __hash__(self) -> int:
        return self._hash

    def __post_init__(self) -> None:
        if not self.groups:
            raise AnnotationError("annotation with no subgroup: give at least one [ranks]{DS}")
        if len(self.groups) != len(self.states):
            raise AnnotationError(
                f"{len(self.groups)} device groups but {len(self.states)} DS: give one DS each"
            )
        if len(self.groups) == 1:
            object.__setattr__(self, "hdim", DUP)
            object.__setattr__(self, "hsizes", None)
        if self.hdim < PARTIAL:
            raise AnnotationError(f"bad hdim {self.hdim}: use >= 0, -1 (D) or -2 (P)")
        if self.hsizes is not None:
            if self.hdim < 0:
                raise AnnotationError(
                    f"part sizes {list(self.hsizes)} given for h{_dim_text(self.hdim)}: "
                    "sizes only apply to a split hdim (h0(...), h1(...))"
                )
            if len(self.hsizes) != len(self.groups) or any(s <= 0 for s in self.hsizes):
                raise AnnotationError(
                    f"part sizes {list(self.hsizes)} must be {len(self.groups)} positive numbers"
                )
        for group, ds in zip(self.groups, self.states, strict=True):
            if ds.num_devices != len(group):
                raise AnnotationError(
                    f"DS {ds} has {ds.num_devices} devices but group {group} has {len(group)}: "
                    "the degrees must multiply to the group size"
                )
        seen: set[int] = set()
        for group in self.groups:
            overlap = seen.intersection(group.ranks)
            if overlap:
                raise AnnotationError(
                    f"rank {min(overlap)} is in two subgroups of {self}: subgroups must be disjoint"
                )
            seen.update(group.ranks)
        object.__setattr__(self, "_hash", hash((self.groups, self.states, self.hdim, self.hsizes)))

    @staticmethod
    def single(ranks: Sequence[int], ds: DistributedStates) -> Annotation:
        return Annotation((DeviceGroup(tuple(ranks)),), (ds,))

    @property
    def hsize(self) -> int:
        return len(self.groups)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for g in self.groups for r in g.ranks)

    def subgroup_of(self, rank: int) -> tuple[int, int]:
        """``(subgroup index, position in its DG)`` of ``rank``."""
        return _rank_index(self)[rank]

    def __contains__(self, rank: object) -> bool:
        return rank in _rank_index(self)

    def __str__(self) -> str:
        body = " ".join(f"{g}{s}" for g, s in zip(self.groups, self.states, strict=True))
        if self.hsize == 1:
            return body
        sizes = "" if self.hsizes is None else "(" + ",".join(map(str, self.hsizes)) + ")"
        return f"h{_dim_text(self.hdim)}{sizes}: {body}"

    # -- geometry -----------------------------------------------------------------------

    def check_shape(self, shape: Sequence[int]) -> None:
        """Raise AnnotationError unless every split divides its dim evenly."""
        _parts(self, tuple(shape))

    def piece(self, rank: int, shape: Sequence[int]) -> Piece:
        """The piece of a tensor of global ``shape`` that ``rank`` holds."""
        return self._pieces_of(tuple(shape))[rank]

    def pieces(self, shape: Sequence[int]) -> dict[int, Piece]:
        """Every rank's piece, in subgroup order."""
        return dict(self._pieces_of(tuple(shape)))

    def _pieces_of(self, shape: tuple[int, ...]) -> dict[int, Piece]:
        found = self._memo.get(shape)
        if found is None:
            found = self._memo[shape] = _pieces(self, shape)
        return found

    # -- JSON -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "groups": [list(g.ranks) for g in self.groups],
            "states": [[list(e) for e in s.entries] for s in self.states],
            "hdim": self.hdim,
            "hsizes": None if self.hsizes is None else list(self.hsizes),
        }

    @staticmethod
    def from_json(data: dict[str, Any] | str) -> Annotation:
        """Accept the dict of ``to_json`` or the text form."""
        if isinstance(data, str):
            return parse_annotation(data)
        try:
            hsizes = data.get("hsizes")
            return Annotation(
                tuple(DeviceGroup(tuple(int(r) for r in g)) for g in data["groups"]),
                tuple(DistributedStates(tuple((d, n) for d, n in s)) for s in data["states"]),
                hdim=int(data.get("hdim", DUP)),
                hsizes=None if hsizes is None else tuple(int(x) for x in hsizes),
            )
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, AnnotationError):
                raise
            raise AnnotationError(
                f"bad annotation JSON {json.dumps(data)}: expected "
                '{"groups": [[0,1]], "states": [[[0,2]]], "hdim": -1, "hsizes": null}'
            ) from error


def _rank_index(annotation: Annotation) -> dict[int, tuple[int, int]]:
    index = annotation._index
    if not index:  # every annotation has a rank: empty means not filled yet
        index.update(
            (r, (s, i)) for s, g in enumerate(annotation.groups) for i, r in enumerate(g.ranks)
        )
    return index


@functools.cache
def _parts(annotation: Annotation, shape: tuple[int, ...]) -> tuple[Region, ...]:
    """The region of the global tensor given to each subgroup (top tier)."""
    full: Region = tuple((0, n) for n in shape)
    hdim, hsize = annotation.hdim, annotation.hsize
    if hdim < 0:
        parts = [full] * hsize
    else:
        if hdim >= len(shape):
            raise AnnotationError(
                f"hdim {hdim} of {annotation} is out of range for shape {list(shape)}"
            )
        sizes = annotation.hsizes or _even_sizes(shape[hdim], hsize, annotation, "subgroups")
        if sum(sizes) != shape[hdim]:
            raise AnnotationError(
                f"part sizes {list(sizes)} of {annotation} add up to {sum(sizes)}, "
                f"but dim {hdim} of shape {list(shape)} is {shape[hdim]}"
            )
        offsets = [sum(sizes[:i]) for i in range(hsize)]
        parts = [_replace(full, hdim, (o, o + s)) for o, s in zip(offsets, sizes, strict=True)]
    for part, ds in zip(parts, annotation.states, strict=True):
        for dim, degree in ds.entries:
            if dim < 0:
                continue
            if dim >= len(shape):
                raise AnnotationError(
                    f"DS {ds} of {annotation} splits dim {dim}, but shape {list(shape)} "
                    f"has {len(shape)} dims"
                )
            length = part[dim][1] - part[dim][0]
            if length % degree:
                raise AnnotationError(
                    f"DS {ds} of {annotation} splits dim {dim} of length {length} "
                    f"{degree} ways, which does not divide: change the degree or the shape"
                )
    return tuple(parts)


def _even_sizes(length: int, count: int, annotation: Annotation, what: str) -> tuple[int, ...]:
    if length % count:
        raise AnnotationError(
            f"{annotation} cuts a dim of length {length} evenly into {count} {what}, which "
            f"does not divide: give part sizes, e.g. h0({','.join(['…'] * count)}):"
        )
    return (length // count,) * count


def _replace(region: Region, dim: int, span: tuple[int, int]) -> Region:
    return region[:dim] + (span,) + region[dim + 1 :]


@functools.cache
def _pieces(annotation: Annotation, shape: tuple[int, ...]) -> dict[int, Piece]:
    """Cached; callers must not mutate the dict (``Annotation.pieces`` hands out a copy)."""
    out = {}
    top_partial = annotation.hdim == PARTIAL
    for s, (part, group, ds) in enumerate(
        zip(_parts(annotation, shape), annotation.groups, annotation.states, strict=True)
    ):
        for position, rank in enumerate(group.ranks):
            region = part
            partial = [s] if top_partial else []
            for (dim, degree), index in zip(ds.entries, ds.indices(position), strict=True):
                if dim == PARTIAL:
                    partial.append(index)
                elif dim >= 0:
                    start, stop = region[dim]
                    step = (stop - start) // degree
                    region = _replace(
                        region, dim, (start + index * step, start + (index + 1) * step)
                    )
            out[rank] = Piece(region, tuple(partial))
    return out


# -- text parsing --------------------------------------------------------------------------

_DS_RE = re.compile(r"\{([^{}]*)\}")
_SUBGROUP_RE = re.compile(r"\s*\[([^\[\]]*)\]\s*(\{[^{}]*\})")
_HEAD_RE = re.compile(r"^\s*h([0-9]+|D|P|d|p)\s*(?:\(([^()]*)\))?\s*:(.*)$", re.S)


def parse_ds(text: str) -> DistributedStates:
    """Parse ``{0:2,D:2}``; ``{}`` is one device."""
    match = _DS_RE.fullmatch(text.strip())
    if not match:
        raise AnnotationError(f"bad DS {text!r}: expected e.g. {{0:2,D:2}}, {{P:2}} or {{}}")
    body = match.group(1).strip()
    entries: list[tuple[int, int]] = []
    for item in filter(None, (x.strip() for x in body.split(","))):
        key, sep, value = item.partition(":")
        if not sep or not value.strip().isdigit():
            raise AnnotationError(f"bad DS entry {item!r} in {text!r}: expected DIM:DEGREE")
        dim = _parse_dim(key)
        if any(d == dim for d, _ in entries):
            raise AnnotationError(
                f"DS {text!r} lists {_dim_text(dim)} twice: a DS is a map, give each dim once"
            )
        entries.append((dim, int(value)))
    return DistributedStates(tuple(entries))


def parse_annotation(text: str) -> Annotation:
    """Parse the text form (see the module docstring)."""
    head = _HEAD_RE.match(text)
    hdim, hsizes, body = DUP, None, text
    if head:
        hdim = _parse_dim(head.group(1).upper() if head.group(1) in "dp" else head.group(1))
        if head.group(2) is not None:
            try:
                hsizes = tuple(int(x) for x in head.group(2).split(","))
            except ValueError:
                raise AnnotationError(
                    f"bad part sizes ({head.group(2)}) in {text!r}: expected e.g. h0(6,2):"
                ) from None
        body = head.group(3)
    groups, states, position = [], [], 0
    while position < len(body.rstrip()):
        match = _SUBGROUP_RE.match(body, position)
        if not match:
            raise AnnotationError(
                f"cannot read {body[position:].strip()!r} in {text!r}: expected subgroups "
                "like [0,1,2,3]{0:2,D:2}, several after h0: / hD: / hP:"
            )
        ranks = match.group(1).strip()
        try:
            numbers = tuple(int(r) for r in ranks.split(",")) if ranks else ()
        except ValueError:
            raise AnnotationError(f"bad ranks [{ranks}] in {text!r}: expected integers") from None
        groups.append(DeviceGroup(numbers))
        states.append(parse_ds(match.group(2)))
        position = match.end()
    if not head and len(groups) > 1:
        raise AnnotationError(
            f"{text!r} has {len(groups)} subgroups but no top tier: start with h0:, hD: or hP:"
        )
    return Annotation(tuple(groups), tuple(states), hdim=hdim, hsizes=hsizes)
