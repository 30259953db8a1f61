"""Variable-length steps: documents packed into each pipeline's micro-batches.

With ``TrainConfig.batch.step_tokens`` a step is whole documents of about that many tokens
(``hspmd.train.batches.step_documents``: the byte corpus's or a token file's), dispatched
to the strategy's pipelines, micro-batches and rows (``hspmd.plan.dispatch``; ``balanced``
unless another dispatcher is given) and packed: each row holds its documents back to back,
then padding to the micro-batch's length::

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
from dataclasses import KW_ONLY, dataclass
from itertools import islice
from typing import Any

import torch

from hspmd.data import DocumentStep
from hspmd.models.build import model_graph
from hspmd.plan.dispatch import Assignment, Dispatcher, DispatchError, balanced
from hspmd.plan.strategy import Strategy
from hspmd.planner.lengths import LengthStrategy, assignment_seconds, fixed_dispatcher
from hspmd.randomness import mask_ops
from hspmd.train.batches import step_documents
from hspmd.train.config import TrainConfig, TrainError

__all__ = [
    "MicroBatch", "PackedStep", "check_packed_dropout", "check_packing", "ignore_index", "length_multiple",
    "length_plans", "pack",
    "packed_steps", "plan_schedule", "planned_steps", "record_fields", "safe_step_tokens",
]  # fmt: skip

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
    _: KW_ONLY
    truncated: int = 0
    dropped: int = 0
    plan: int | None = None  # with length plans: the strategy chosen for this step
    predicted: float | None = None  # its predicted step seconds (without the switch)

    @property
    def tokens(self) -> int:
        return sum(mb.real_tokens for pipe in self.micro_batches for mb in pipe)

    def scale(self, pipeline: int, micro_batch: int) -> float:
        """The weight of micro-batch ``(pipeline, micro_batch)``'s mean token loss."""
        return self.micro_batches[pipeline][micro_batch].real_tokens / self.tokens


def length_multiple(strategy: Strategy, *, sequence_parallel: bool) -> int:
    """What packed lengths are rounded up to: every CP degree, and under sequence
    parallelism the TP degree of every stage without CP (its residual is split on the
    sequence); else 1."""
    return math.lcm(*(
        stage.cp if stage.cp > 1 else stage.tp if sequence_parallel else 1
        for _, _, stage in strategy.stages()
    ))  # fmt: skip


def pack(
    step: DocumentStep, assignment: Assignment, *, plan: int | None = None,
    predicted: float | None = None, ignore: int = IGNORE,
) -> PackedStep:  # fmt: skip
    """The micro-batches of ``step`` as ``assignment`` places its documents; ``ignore``: the
    padding's target, the model loss's ``ignore_index`` (nanoGPT's is -1)."""
    rows: dict[tuple[int, int, int], list[torch.Tensor]] = {}
    for doc, slot in zip(step.documents, assignment.slots, strict=True):
        rows.setdefault(slot, []).append(doc)
    pipelines = []
    for p, lengths in enumerate(assignment.lengths):
        num_rows = assignment.rows[p]
        micro = []
        for m, length in enumerate(lengths):
            tokens = torch.zeros(num_rows, length, dtype=torch.int64)
            targets = torch.full((num_rows, length), ignore, dtype=torch.int64)
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
    return PackedStep(tuple(pipelines), assignment, truncated=step.truncated,
                      dropped=step.dropped, plan=plan, predicted=predicted)  # fmt: skip


def packed_steps(
    config: TrainConfig, strategy: Strategy, *, dispatch: Dispatcher = balanced
) -> Iterator[PackedStep]:
    """The ``config.steps`` packed steps of a run under ``strategy``, in order.

    ``dispatch(lengths, slots=, max_len=, multiple=)`` places each step's documents: the
    hook for a length-aware planner's dispatcher."""
    ignore = ignore_index(config)
    for step, assignment in _dispatched(config, strategy, dispatch=dispatch):
        yield pack(step, assignment, ignore=ignore)


def ignore_index(config: TrainConfig) -> int:
    """The target that the model's loss ignores (``IGNORE`` unless it says otherwise)."""
    return int(getattr(config.model_config(), "ignore_index", IGNORE))


def _dispatched(
    config: TrainConfig, strategy: Strategy, *, dispatch: Dispatcher = balanced
) -> Iterator[tuple[DocumentStep, Assignment]]:
    """Each step's documents and where ``dispatch`` puts them (``packed_steps``, unpacked)."""
    assert config.batch.step_tokens is not None
    slots = [(p.num_micro_batches, p.micro_batch_size) for p in strategy.pipelines]
    multiple = length_multiple(strategy, sequence_parallel=config.options.sequence_parallel)
    stream = step_documents(
        config, min_documents=max(config.batch.min_documents, sum(m for m, _ in slots))
    )
    for step in islice(stream, config.steps):
        yield (
            step,
            dispatch(step.lengths, slots=slots, max_len=config.batch.seq_len, multiple=multiple),
        )


def safe_step_tokens(strategy: Strategy, max_len: int) -> int:
    """The most tokens a step may hold such that its whole documents always pack into
    ``strategy``'s rows of ``max_len`` tokens, whatever their lengths: rows x
    ceil((max_len + 1) / 2).

    Why: documents go longest first to any row they fit (``balanced``). One of ``n`` tokens
    fits no row only when every row holds more than ``max_len - n`` tokens, and, if ``n``
    is over half a row, a document at least as long as itself; so every row holds at least
    ceil((max_len + 1) / 2) tokens already. Documents of half a row plus one reach it: one
    a row, whatever the row's length.

    >>> from hspmd.plan.strategy import parse_strategy
    >>> safe_step_tokens(parse_strategy("2x1: R0:L0-3; 1x2: R1:L0-3"), 64)  # 4 rows
    132
    """
    rows = sum(p.batch_size for p in strategy.pipelines)
    return rows * ((max_len + 2) // 2)


def check_packed_dropout(config: TrainConfig) -> None:
    """Refuse packed documents with a model that drops: its masks are keyed by the row of
    the step's batch (DESIGN decision 17), and packed rows are laid out per strategy."""
    if not config.batch.packed:
        return
    model = config.model_config()
    drops = list(mask_ops(model_graph(model).graph))
    if drops:
        modules = list(drops[0].meta.get("nn_module_stack") or ())
        where = f" in {modules[-1]}" if modules else ""
        raise TrainError(
            f"--tokens-per-step: {model.name} drops ({len(drops)} dropout ops, the first "
            f"{drops[0].name}{where}), and hspmd keys dropout masks by the row of the step's "
            "batch, which packed documents do not have: set its dropout to 0, or train "
            "without --tokens-per-step"
        )


def check_packing(config: TrainConfig, strategy: Strategy) -> None:
    """Dispatch every step of the run (no tensors) before any process starts: a step whose
    documents do not pack is a ``TrainError`` naming it and the bound that always packs."""
    done = 0  # steps dispatched
    try:
        for _ in _dispatched(config, strategy):
            done += 1
    except DispatchError as error:
        bound = safe_step_tokens(strategy, config.batch.seq_len)
        rows = sum(p.batch_size for p in strategy.pipelines)
        raise TrainError(
            f"--tokens-per-step {config.batch.step_tokens}: the documents of step {done + 1} "
            f"do not pack into the strategy's {rows} rows of --max-seq-len {config.batch.seq_len} "
            f"({error}); whole documents leave gaps in rows: at most {bound} tokens a step "
            f"({rows} rows x {(config.batch.seq_len + 2) // 2}) always pack, or raise "
            "--max-seq-len or the pipelines' micro-batches"
        ) from None


def length_plans(config: TrainConfig) -> tuple[list[LengthStrategy], list[list[float]]]:
    """The strategies and switch times of ``config.switching.length_plans``."""
    assert config.switching.length_plans is not None
    plans = config.switching.length_plans
    return list(plans.plans), [list(row) for row in plans.switch_s]


def plan_schedule(config: TrainConfig) -> list[tuple[int, float, float]]:
    """Per step ``(plan, predicted seconds, predicted switch seconds)``: see
    ``planned_steps``."""
    return [(s.plan or 0, s.predicted or 0.0, sw) for s, sw in _planned(config)]


def planned_steps(config: TrainConfig) -> Iterator[PackedStep]:
    """The packed steps of a run under length plans (``hspmd train --plans``): per step the
    strategy with the least predicted time plus switch from the one before
    (``planner.lengths.choose``, each strategy's micro-batches fixed, dispatched by
    ``fixed_dispatcher``: a micro-batch may stay empty, the runtime skips it; a strategy
    with more pipelines than the step has documents, or whose rows cannot hold it, is
    passed over), packed as that strategy's pipelines take them."""
    for step, _ in _planned(config):
        yield step


def _planned(config: TrainConfig) -> Iterator[tuple[PackedStep, float]]:
    assert config.batch.step_tokens is not None
    plans, switch = length_plans(config)
    strategies = [p.strategy for p in plans]
    multiples = [
        length_multiple(s, sequence_parallel=config.options.sequence_parallel) for s in strategies
    ]
    stream = step_documents(
        config,
        min_documents=max(config.batch.min_documents, min(len(s.pipelines) for s in strategies)),
    )
    current: int | None = None
    ignore = ignore_index(config)
    for step in islice(stream, config.steps):
        best: tuple[float, int, Assignment, float, float] | None = None
        for k, (plan, strategy) in enumerate(zip(plans, strategies, strict=True)):
            slots = [(p.num_micro_batches, p.micro_batch_size) for p in strategy.pipelines]
            try:
                a = fixed_dispatcher(plan)(step.lengths, slots=slots, max_len=config.batch.seq_len,
                                           multiple=multiples[k])  # fmt: skip
            except DispatchError:
                continue
            t = assignment_seconds(a, plan)
            s = switch[current][k] if current is not None and current != k else 0.0
            if best is None or t + s < best[0]:
                best = (t + s, k, a, t, s)
        if best is None:
            raise DispatchError(
                f"a step of {len(step.lengths)} documents ({sum(step.lengths)} tokens, longest "
                f"{max(step.lengths)}) fits no strategy of --plans: plan again with these "
                "--tokens-per-step and --max-seq-len"
            )
        _, k, a, t, s = best
        current = k
        yield pack(step, a, plan=k, predicted=t, ignore=ignore), s


def record_fields(step: PackedStep) -> dict[str, Any]:
    """A packed step's ``StepRecord`` fields: real tokens, documents and tokens per
    pipeline, long documents truncated and dropped."""
    a = step.assignment
    out = {
        "tokens": step.tokens, "sequences": a.sequences_per_pipeline,
        "pipeline_tokens": a.tokens_per_pipeline, "truncated": step.truncated,
        "dropped": step.dropped,
    }  # fmt: skip
    if step.plan is not None:
        out |= {"plan": step.plan, "predicted_seconds": step.predicted}
    return out
