"""A single-process simulator of many ranks: runs a CommPlan on numpy arrays.

``scatter`` makes every rank's local tensor from a global one (splitting partial values at
random), ``simulate`` applies a plan step by step, and ``assemble`` rebuilds the global tensor
from local ones, checking that copies agree. The runtime executors must give exactly what
this module gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hspmd.annotation import PARTIAL, Annotation, Piece
from hspmd.comm.plan import (
    AllGather,
    AllReduce,
    AllToAll,
    BatchedSendRecv,
    CommPlan,
    Local,
    ReduceScatter,
    SendRecv,
    SplitAllGather,
    SplitAllReduce,
    SplitReduceScatter,
    Step,
    intersect,
    local_box,
)
from hspmd.errors import ResolutionError

Locals = dict[int, np.ndarray]
Shape = tuple[int, ...]


def scatter(
    annotation: Annotation, value: np.ndarray, *, rng: np.random.Generator | None = None
) -> Locals:
    """Every rank's local tensor of ``value`` under ``annotation``.

    Partial values are split into random summands (or, with ``rng=None``, the first summand
    holds everything and the others zeros): across subgroups for ``hP``, then within each
    subgroup over its own partial axis. Under ``hD`` or ``h{k}`` every subgroup holds the
    whole value of its part, whatever the other subgroups' DS.
    """
    value = value.astype(np.float64, copy=False)
    pieces = annotation.pieces(value.shape)
    top = (
        _summands(value, annotation.hsize, rng)
        if annotation.hdim == PARTIAL
        else [value] * annotation.hsize
    )
    out: Locals = {}
    for group, whole in zip(annotation.groups, top, strict=True):
        keys = sorted({pieces[r].partial for r in group.ranks})
        fields = dict(zip(keys, _summands(whole, len(keys), rng), strict=True))
        for r in group.ranks:
            out[r] = fields[pieces[r].partial][_box(pieces[r])].copy()
    return out


def _summands(value: np.ndarray, count: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    """``count`` arrays that add up to ``value``."""
    if rng is None:
        return [value.copy()] + [np.zeros(value.shape) for _ in range(count - 1)]
    parts = [rng.standard_normal(value.shape) for _ in range(count - 1)]
    return parts + [value - sum(parts, np.zeros(value.shape))]


def _box(piece: Piece) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in piece.region)


def assemble(
    annotation: Annotation, shape: tuple[int, ...], locals_: Mapping[int, np.ndarray]
) -> np.ndarray:
    """The global tensor; raises AssertionError if copies differ or a part is not covered.

    Each subgroup's value is the sum over its partial summands; subgroups then add up
    (``hP``), must agree (``hD``), or each give their part (``h{k}``).
    """
    pieces = annotation.pieces(shape)
    out = np.zeros(shape)
    for s, group in enumerate(annotation.groups):
        fields: dict[tuple[int, ...], np.ndarray] = {}
        filled: dict[tuple[int, ...], np.ndarray] = {}
        for rank in group.ranks:
            piece, data = pieces[rank], locals_[rank]
            if data.shape != piece.shape:
                raise ResolutionError(
                    f"rank {rank} passed an array of shape {data.shape}, but its piece under "
                    f"{annotation} of {shape} has shape {piece.shape}: pass the piece's shape"
                )
            field = fields.setdefault(piece.partial, np.zeros(shape))
            mask = filled.setdefault(piece.partial, np.zeros(shape, dtype=bool))
            box = _box(piece)
            if mask[box].any():
                np.testing.assert_allclose(
                    data[mask[box].reshape(data.shape)],
                    field[box][mask[box]],
                    err_msg=f"copy on rank {rank} differs",
                )
            field[box] = data
            mask[box] = True
        value = sum(fields.values(), np.zeros(shape))
        part = _part_box(annotation, s, pieces, group.ranks)
        for key, mask in filled.items():
            if not mask[part].all():
                raise ResolutionError(f"subgroup {s} summand {key} does not cover its part")
        if annotation.hdim == PARTIAL or s == 0:
            out[part] += value[part]
        elif annotation.hdim >= 0:
            out[part] = value[part]
        else:
            np.testing.assert_allclose(value, out, err_msg=f"subgroup {s} differs from subgroup 0")
    return out


def _part_box(
    annotation: Annotation, subgroup: int, pieces: Mapping[int, Piece], ranks: tuple[int, ...]
) -> tuple[slice, ...]:
    """The box a subgroup covers: the bounding box of its pieces."""
    regions = [pieces[r].region for r in ranks]
    return tuple(
        slice(min(r[d][0] for r in regions), max(r[d][1] for r in regions))
        for d in range(len(regions[0]))
    )


def simulate(plan: CommPlan, locals_: Mapping[int, np.ndarray]) -> Locals:
    """Apply ``plan`` to the source locals; returns the destination locals."""
    state = {r: np.asarray(locals_[r], dtype=np.float64) for r in plan.src.ranks}
    for before, step, after in zip(plan.layouts[:-1], plan.steps, plan.layouts[1:], strict=True):
        state = _RUNNERS[type(step)](step, state, before, after, plan.shape)
    return {r: state[r] for r in plan.dst.ranks}


Runner = Callable[[Any, Locals, Annotation, Annotation, Shape], Locals]


def _carry(state: Locals, step: Step, after: Annotation) -> Locals:
    """Ranks a step does not touch keep their tensors (if they hold a piece after it)."""
    return {r: t for r, t in state.items() if r not in step.ranks and r in after}


def _all_reduce(
    step: Any, state: Locals, before: Annotation, after: Annotation, shape: Shape
) -> Locals:
    out = _carry(state, step, after)
    for group in step.groups:
        total = sum(state[r] for r in group)
        out.update({r: np.array(total) for r in group})
    return out


def _reduce_scatter(
    step: Any, state: Locals, before: Annotation, after: Annotation, shape: Shape
) -> Locals:
    out = _carry(state, step, after)
    for group in step.groups:
        chunks = np.split(sum(state[r] for r in group), len(group), axis=step.dim)
        out.update({r: chunks[i].copy() for i, r in enumerate(group)})
    return out


def _all_gather(
    step: Any, state: Locals, before: Annotation, after: Annotation, shape: Shape
) -> Locals:
    out = _carry(state, step, after)
    for group in step.groups:
        whole = np.concatenate([state[r] for r in group], axis=step.dim)
        out.update({r: whole.copy() for r in group})
    return out


def _all_to_all(
    step: Any, state: Locals, before: Annotation, after: Annotation, shape: Shape
) -> Locals:
    out = _carry(state, step, after)
    for group in step.groups:
        chunks = {r: np.split(state[r], len(group), axis=step.split_dim) for r in group}
        for j, r in enumerate(group):
            out[r] = np.concatenate([chunks[s][j] for s in group], axis=step.concat_dim)
    return out


def _send_recv(
    step: Any, state: Locals, before: Annotation, after: Annotation, shape: Shape
) -> Locals:
    out = _carry(state, step, after)
    for src, dst in step.pairs:
        out[dst] = state[src].copy()
    return out


def _local(step: Any, state: Locals, before: Annotation, after: Annotation, shape: Shape) -> Locals:
    out = _carry(state, step, after)
    for rank in step.zero:
        out[rank] = np.zeros(after.piece(rank, shape).shape)
    for rank in step.keep:
        old, new = before.piece(rank, shape), after.piece(rank, shape)
        data = np.zeros(new.shape)
        common = intersect(old.region, new.region)
        if common is not None:
            data[local_box(new, common)] = state[rank][local_box(old, common)]
        out[rank] = data
    return out


def _slice_sum(piece: Any, state: Locals, before: Annotation, shape: Shape) -> np.ndarray:
    """The sum of ``piece.region`` over the slice's ranks, less those that add zeros."""
    return sum(
        (
            state[r][local_box(before.piece(r, shape), piece.region)]
            for r in piece.ranks
            if r not in piece.zero
        ),
        np.zeros(tuple(b - a for a, b in piece.region)),
    )


def _fresh(step: Any, after: Annotation, shape: Shape) -> Locals:
    """New pieces for the step's ranks, NaN until written (so a gap is caught)."""
    return {r: np.full(after.piece(r, shape).shape, np.nan) for r in step.ranks if r in after}


def _check_filled(fresh: Locals, kind: str) -> None:
    if any(np.isnan(t).any() for t in fresh.values()):
        raise ResolutionError(f"{kind} left a gap: a plan step wrote no value there")


def _split_all_reduce(
    step: Any, state: Locals, before: Annotation, after: Annotation, shape: Shape
) -> Locals:
    out = {r: t.copy() for r, t in state.items() if r in after}
    for s in step.slices:
        total = _slice_sum(s, state, before, shape)
        for r in s.ranks:
            out[r][local_box(after.piece(r, shape), s.region)] = total
    return out


def _split_reduce_scatter(
    step: Any, state: Locals, before: Annotation, after: Annotation, shape: Shape
) -> Locals:
    out = _carry(state, step, after)
    fresh = _fresh(step, after, shape)
    for s in step.slices:
        total = _slice_sum(s, state, before, shape)
        fresh[s.root][local_box(after.piece(s.root, shape), s.region)] = total
    _check_filled(fresh, step.kind)
    out.update(fresh)
    return out


def _split_all_gather(
    step: Any, state: Locals, before: Annotation, after: Annotation, shape: Shape
) -> Locals:
    out = _carry(state, step, after)
    fresh = _fresh(step, after, shape)
    for s in step.slices:
        for owner, region in s.owners:
            data = state[owner][local_box(before.piece(owner, shape), region)]
            for r in s.ranks:
                fresh[r][local_box(after.piece(r, shape), region)] = data
    _check_filled(fresh, step.kind)
    out.update(fresh)
    return out


def _bsr(step: Any, state: Locals, before: Annotation, after: Annotation, shape: Shape) -> Locals:
    out = _carry(state, step, after)
    fresh = {t.dst: np.full(after.piece(t.dst, shape).shape, np.nan) for t in step.transfers}
    for t in step.transfers:
        data = state[t.src][local_box(before.piece(t.src, shape), t.region)]
        fresh[t.dst][local_box(after.piece(t.dst, shape), t.region)] = data
    _check_filled(fresh, step.kind)
    out.update(fresh)
    return out


_RUNNERS: dict[type, Runner] = {
    AllReduce: _all_reduce,
    ReduceScatter: _reduce_scatter,
    AllGather: _all_gather,
    AllToAll: _all_to_all,
    SendRecv: _send_recv,
    Local: _local,
    SplitAllReduce: _split_all_reduce,
    SplitReduceScatter: _split_reduce_scatter,
    SplitAllGather: _split_all_gather,
    BatchedSendRecv: _bsr,
}
