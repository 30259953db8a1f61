"""Variable-length steps: documents packed into each pipeline's micro-batches.

With ``TrainConfig.step_tokens`` a step is whole documents of about that many tokens
(``hspmd.data.document_steps``), dispatched to the strategy's pipelines, micro-batches and
rows (``hspmd.plan.dispatch``; ``balanced`` unless another dispatcher is given) and packed:
each row holds its documents back to back, then padding to the micro-batch's length::

    row      doc 3 (5 tokens)   doc 8 (2)   padding
    tokens   t t t t t          t t         0 0 0
    targets  t t t t t          t t         -100 -100 -100   (no loss on padding)
    segments 0 0 0 0 0          1 1         2 2 2            (block-diagonal attention)

Micro-batch ``(p, m)``'s loss is the mean over its real tokens, weighted by its share of
the step's real tokens (``PackedStep.scale``), so the step's loss is the mean over every
real token, whatever the strategy (DESIGN decision 6). Every rank and the reference
compute the same packing from the same data and strategy.

>>> from hspmd.data import DocumentStep
>>> from hspmd.plan.dispatch import balanced
>>> docs = DocumentStep(tuple(torch.arange(n + 1) for n in (5, 2, 4)))
>>> step = pack(docs, balanced(docs.lengths, slots=[(1, 2)], max_len=8))
>>> mb = step.micro_batches[0][0]
>>> mb.segments.tolist(), mb.real_tokens, step.scale(0, 0)
([[0, 0, 0, 0, 0, 1], [0, 0, 1, 1, 1, 1]], 11, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch

from hspmd.data import DEFAULT_MAX_BYTES, DocumentStep, document_steps
from hspmd.plan.dispatch import Assignment, Dispatcher, balanced
from hspmd.plan.strategy import Strategy
from hspmd.train.config import TrainConfig

__all__ = ["MicroBatch", "PackedStep", "length_multiple", "pack", "packed_steps", "record_fields"]

IGNORE = -100
"""The target of padding: ``F.cross_entropy``'s default ``ignore_index``."""


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """``(rows, T)`` tokens, targets (``IGNORE`` on padding) and document ids."""

    tokens: torch.Tensor
    targets: torch.Tensor
    segments: torch.Tensor
    real_tokens: int


@dataclass(frozen=True, slots=True)
class PackedStep:
    """One step's micro-batches, per pipeline, and where its documents went."""

    micro_batches: tuple[tuple[MicroBatch, ...], ...]
    assignment: Assignment
    truncated: int = 0
    dropped: int = 0

    @property
    def tokens(self) -> int:
        return sum(mb.real_tokens for pipe in self.micro_batches for mb in pipe)

    def scale(self, pipeline: int, micro_batch: int) -> float:
        """The weight of micro-batch ``(pipeline, micro_batch)``'s mean token loss."""
        return self.micro_batches[pipeline][micro_batch].real_tokens / self.tokens


def length_multiple(strategy: Strategy, *, sequence_parallel: bool) -> int:
    """What packed lengths are rounded up to: every TP degree under sequence parallelism
    (the residual is split on the sequence), else 1."""
    if not sequence_parallel:
        return 1
    return math.lcm(*(stage.tp for _, _, stage in strategy.stages()))


def pack(step: DocumentStep, assignment: Assignment) -> PackedStep:
    """The micro-batches of ``step`` as ``assignment`` places its documents."""
    rows: dict[tuple[int, int, int], list[torch.Tensor]] = {}
    for doc, slot in zip(step.documents, assignment.slots, strict=True):
        rows.setdefault(slot, []).append(doc)
    pipelines = []
    for p, lengths in enumerate(assignment.lengths):
        num_rows = assignment.rows[p]
        micro = []
        for m, length in enumerate(lengths):
            tokens = torch.zeros(num_rows, length, dtype=torch.int64)
            targets = torch.full((num_rows, length), IGNORE, dtype=torch.int64)
            segments = torch.zeros(num_rows, length, dtype=torch.int64)
            real = 0
            for r in range(num_rows):
                at = 0
                for index, doc in enumerate(rows.get((p, m, r), [])):
                    n = len(doc) - 1
                    tokens[r, at : at + n], targets[r, at : at + n] = doc[:-1], doc[1:]
                    segments[r, at : at + n] = index
                    at += n
                segments[r, at:] = len(rows.get((p, m, r), []))  # padding: its own document
                real += at
            micro.append(MicroBatch(tokens, targets, segments, real))
        pipelines.append(tuple(micro))
    return PackedStep(tuple(pipelines), assignment, step.truncated, step.dropped)


def packed_steps(
    config: TrainConfig, strategy: Strategy, *, dispatch: Dispatcher = balanced
) -> Iterator[PackedStep]:
    """The ``config.steps`` packed steps of a run under ``strategy``, in order.

    ``dispatch(lengths, slots=, max_len=, multiple=)`` places each step's documents: the
    hook for a length-aware planner's dispatcher."""
    assert config.step_tokens is not None
    slots = [(p.num_micro_batches, p.micro_batch_size) for p in strategy.pipelines]
    multiple = length_multiple(strategy, sequence_parallel=config.sequence_parallel)
    stream = document_steps(
        config.step_tokens,
        config.seed,
        max_len=config.seq_len,
        long_docs=config.long_docs,
        min_documents=sum(m for m, _ in slots),
        path=config.data,
        max_bytes=config.data_max_bytes or DEFAULT_MAX_BYTES,
    )
    for step in islice(stream, config.steps):
        assignment = dispatch(step.lengths, slots=slots, max_len=config.seq_len, multiple=multiple)
        yield pack(step, assignment)


def record_fields(step: PackedStep) -> dict[str, Any]:
    """A packed step's ``StepRecord`` fields: real tokens, documents and tokens per
    pipeline, long documents truncated and dropped."""
    a = step.assignment
    return {
        "tokens": step.tokens, "sequences": a.sequences_per_pipeline,
        "pipeline_tokens": a.tokens_per_pipeline, "truncated": step.truncated,
        "dropped": step.dropped,
    }  # fmt: skip
