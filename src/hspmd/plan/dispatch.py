"""Dispatch: which pipeline, micro-batch and row each document of a step is packed into.

A strategy's pipeline ``p`` runs ``micro_batches[p]`` micro-batches of ``rows[p]`` rows;
a row packs whole documents back to back, at most ``max_len`` tokens; a micro-batch is as
long as its longest row, rounded up to ``multiple`` (the executable's length multiple).
``balanced`` spreads the documents so that the pipelines finish together: documents in
decreasing cost (longest first), each to the pipeline with the least cost per unit of
``speed``, and there to the least loaded row it fits in (empty micro-batches first; the
last documents go to the micro-batches still empty, so that every one gets one)::

    lengths 9 7 5 4 2 1, two pipelines of 1 micro-batch x 1 row, max_len 16
    pipeline 0: 9 4 1   (14 tokens)     pipeline 1: 7 5 2   (14 tokens)

    >>> a = balanced([9, 7, 5, 4, 2, 1], slots=[(1, 1), (1, 1)], max_len=16)
    >>> a.slots
    ((0, 0, 0), (1, 0, 0), (1, 0, 0), (0, 0, 0), (1, 0, 0), (0, 0, 0))
    >>> a.lengths, a.tokens_per_pipeline, a.sequences_per_pipeline
    (((14,), (14,)), (14, 14), (3, 3))

``cost`` weighs a document (default: its tokens; ``attention_cost`` adds the quadratic
attention term). The result is data (``Assignment``); the trainer packs by it
(``hspmd.train.packing``). A length-aware planner can pass its own dispatcher: any function
of ``(lengths, slots=, max_len=, multiple=)`` returning an ``Assignment``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hspmd.errors import HspmdError

__all__ = ["Assignment", "DispatchError", "Dispatcher", "attention_cost", "balanced"]


class DispatchError(HspmdError, ValueError):
    """A step whose documents do not fit the strategy's rows."""


@dataclass(frozen=True, slots=True)
class Assignment:
    """``slots[i]``: the ``(pipeline, micro_batch, row)`` of document ``i``;
    ``lengths[p][m]``: the packed length of micro-batch ``m`` of pipeline ``p``, whose
    micro-batches have ``rows[p]`` rows; ``doc_lengths[i]``: document ``i``'s tokens."""

    slots: tuple[tuple[int, int, int], ...]
    lengths: tuple[tuple[int, ...], ...]
    rows: tuple[int, ...]
    doc_lengths: tuple[int, ...]

    @property
    def tokens_per_pipeline(self) -> tuple[int, ...]:
        out = [0] * len(self.lengths)
        for (p, _, _), n in zip(self.slots, self.doc_lengths, strict=True):
            out[p] += n
        return tuple(out)

    @property
    def sequences_per_pipeline(self) -> tuple[int, ...]:
        out = [0] * len(self.lengths)
        for p, _, _ in self.slots:
            out[p] += 1
        return tuple(out)


Dispatcher = Callable[..., Assignment]


def attention_cost(length: int, *, hidden: int = 64) -> float:
    """A document's relative compute: linear layers per token plus causal attention
    (``length^2 / 2`` score entries against ``~12 hidden`` FLOP-equivalents per token)."""
    return length * 12 * hidden + length * length / 2


def balanced(
    lengths: Sequence[int],
    *,
    slots: Sequence[tuple[int, int]],
    max_len: int,
    multiple: int = 1,
    cost: Callable[[int], float] | None = None,
    speeds: Sequence[float] | None = None,
) -> Assignment:
    """Assign documents of ``lengths`` to ``slots`` = ``(micro_batches, rows)`` per pipeline
    (module docstring). ``speeds``: relative pipeline speeds (default all 1). Raises
    DispatchError when a document does not fit any row, or a micro-batch stays empty."""
    if max_len % multiple:
        raise DispatchError(
            f"max_len={max_len} is not a multiple of {multiple} (the strategy's length "
            f"multiple): use a max_len of {max_len // multiple * multiple or multiple}"
        )
    weigh = cost or float
    rate = list(speeds or [1.0] * len(slots))
    load = [[[0] * rows for _ in range(mbs)] for mbs, rows in slots]
    pipe_cost = [0.0] * len(slots)
    out: list[tuple[int, int, int]] = [(-1, -1, -1)] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (-weigh(lengths[i]), i))
    for k, i in enumerate(order):
        n = lengths[i]
        if n > max_len:
            raise DispatchError(f"document {i} has {n} tokens, more than max_len={max_len}")
        # as many documents left as empty micro-batches: each must fill one
        empty = [sum(not any(rows) for rows in pipe) for pipe in load]
        must_fill = len(order) - k <= sum(empty)
        best = None
        for p in sorted(range(len(slots)), key=lambda p: (pipe_cost[p] / rate[p], p)):
            if must_fill and not empty[p]:
                continue
            best = _row(load[p], n, max_len)
            if best is not None:
                out[i] = (p, *best)
                load[p][best[0]][best[1]] += n
                pipe_cost[p] += weigh(n)
                break
        if best is None:
            raise DispatchError(
                f"document {i} ({n} tokens) fits no row: every row of the strategy's "
                f"{sum(m * r for m, r in slots)} rows is full at max_len={max_len}; lower "
                "the tokens per step or raise the maximum sequence length"
            )
    left = [(p, m) for p, rows in enumerate(load) for m, r in enumerate(rows) if not any(r)]
    if left:
        raise DispatchError(
            f"{len(lengths)} documents leave micro-batch {left[0][1]} of pipeline "
            f"{left[0][0]} empty: a step needs at least one document per micro-batch"
        )
    packed = tuple(
        tuple(math.ceil(max(rows) / multiple) * multiple for rows in pipe) for pipe in load
    )
    rows = tuple(r for _, r in slots)
    return Assignment(tuple(out), packed, rows, tuple(int(n) for n in lengths))


def _row(load: list[list[int]], n: int, max_len: int) -> tuple[int, int] | None:
    """The ``(micro_batch, row)`` for a document of ``n`` tokens: an empty micro-batch
    first, else the least loaded row it fits in (ties: the first)."""
    best, key = None, None
    for m, rows in enumerate(load):
        for r, used in enumerate(rows):
            if used + n > max_len:
                continue
            here = (any(rows), used, m, r)  # empty micro-batches first, then least loaded
            if key is None or here < key:
                best, key = (m, r), here
    return best
