"""Packed variable-length steps in an elastic run: the length-aware set and its re-plans.

``hspmd train --elastic --plans FILE`` (or ``--tokens-per-step N --strategy S``) trains
whole documents packed per step, as ``hspmd.train.packing`` does, on ranks that may die,
hang or join (``hspmd.train.elastic``). Per rank, ``Lengths`` holds:

- the documents of each step (a function of the step's number and the config only: the
  interrupted step is redone with the same documents whatever strategy runs it);
- the *set* running now: the plans file's strategies, or ``--strategy`` alone (dispatched
  by ``plan.dispatch.balanced``), then after each failure or growth the set that
  ``planner.combined.LengthPlanner`` gives for the ranks left (slowed ranks included:
  ``local_cost(slowdown=)``), warm-started from the set before;
- per step the choice (``choose``): each strategy's fixed micro-batches dispatched
  (``fixed_dispatcher``), its predicted time plus the switch of the states from the
  strategy running now; the least wins (every rank chooses alike, from the same data).

Re-planning is rank 0's (``replan_record``, published through the store as a plans file);
every rank reads it (``take``) and adopts the set only with the recovery's state
(``commit``), so a recovery that fails again plans again from the same set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

from hspmd.cost.captured import planning_model
from hspmd.data import DocumentStep
from hspmd.plan.dispatch import Assignment, DispatchError, balanced
from hspmd.plan.strategy import Strategy, check_strategy
from hspmd.planner.combined import LengthPlanner, LengthSet, StatesSwitch
from hspmd.planner.length_model import Histogram, LengthStrategy
from hspmd.planner.lengths import assignment_seconds, fixed_dispatcher, load_plans, plans_json
from hspmd.planner.local import local_cost
from hspmd.switch.survivors import renumber_strategy
from hspmd.train.batches import step_documents
from hspmd.train.config import TrainConfig, TrainError
from hspmd.train.packing import PackedStep, length_multiple, length_plans, pack
from hspmd.train.slowdown import slowdown_of

__all__ = ["SAMPLE_STEPS", "Choice", "Lengths", "StrategySet", "document_rows", "documents_floor"]

SAMPLE_STEPS = 32  # steps of the run's data whose lengths the re-plans plan for
MAXIMA = 4  # maximum lengths a re-planned set has at most


def documents_floor(config: TrainConfig) -> int:
    """The least documents a step holds: what the reference's packing asks
    (``train.packing``: the plans' fewest pipelines, or the strategy's micro-batches) and
    ``config.batch.min_documents`` (an elastic run of packed documents: a document a rank at
    least, ``TrainConfig``), so the run and its reference read the same documents."""
    if config.switching.length_plans is not None:
        plans, _ = length_plans(config)
        least = min(len(p.strategy.pipelines) for p in plans)
    else:
        least = sum(p.num_micro_batches for p in config.require_strategy().pipelines)
    return max(config.batch.min_documents, least)


def document_rows(config: TrainConfig) -> Iterator[PackedStep]:
    """The reference's packing of an elastic run's steps: the same documents
    (``documents_floor``), each a micro-batch of one row of its own (the step's loss, the
    mean over its real tokens, does not depend on the packing; the run's re-plans do)."""
    stream = step_documents(config, min_documents=documents_floor(config))
    for docs in islice(stream, config.steps):
        n = docs.lengths
        a = Assignment(tuple((i, 0, 0) for i in range(len(n))), tuple((x,) for x in n),
                       (1,) * len(n), n)  # fmt: skip
        yield pack(docs, a)


@dataclass(frozen=True, slots=True)
class StrategySet:
    """Strategies (in the generation's numbers; ``plans[k]`` None: ``--strategy``
    dispatched by ``balanced``) and the predicted switch between each pair."""

    plans: tuple[LengthStrategy | None, ...]
    strategies: tuple[Strategy, ...]
    switch: tuple[tuple[float, ...], ...]


@dataclass(frozen=True, slots=True)
class Choice:
    """A step's strategy (index in the set and the strategy), its packing and predictions."""

    index: int
    strategy: Strategy
    batch: PackedStep
    predicted: float | None
    switch: float


class Lengths:
    """One rank's view of an elastic run's packed steps (module docstring)."""

    def __init__(self, config: TrainConfig) -> None:
        assert config.batch.step_tokens is not None
        self.config = config
        self.floor = documents_floor(config)
        self._docs: dict[int, DocumentStep] = {}
        self._stream: Any = None
        self._next = 1  # the step the stream gives next
        if config.switching.length_plans is not None:
            plans, switch = length_plans(config)
            self.set = StrategySet(tuple(plans), tuple(p.strategy for p in plans),
                                   tuple(map(tuple, switch)))  # fmt: skip
        else:
            self.set = StrategySet((None,), (config.require_strategy(),), ((0.0,),))
        self._pending: StrategySet | None = None
        self._samples: list[list[int]] | None = None

    def documents(self, step: int) -> DocumentStep:
        """Step ``step``'s documents (the same on every rank, whatever runs it)."""
        if step in self._docs:
            return self._docs[step]
        if self._stream is None or step < self._next:
            self._stream = step_documents(self.config, min_documents=self.floor)
            self._next = 1
        for number, docs in enumerate(islice(self._stream, step - self._next + 1), self._next):
            self._docs[number] = docs
        self._next = step + 1
        for old in [s for s in self._docs if s < step - 2]:
            del self._docs[old]
        return self._docs[step]

    def choose(self, step: int, running: Strategy | None, of: StrategySet | None = None) -> Choice:
        """The strategy of the set (``of``, else the one running now) for ``step``: least
        predicted time plus the switch from ``running`` (module docstring); raises
        ``TrainError`` if none takes it."""
        docs, group = self.documents(step), of or self.set
        found = running is not None and running in group.strategies
        current = group.strategies.index(running) if found else None
        best: tuple[float, int, Assignment, float | None, float] | None = None
        for k, (plan, strategy) in enumerate(zip(group.plans, group.strategies, strict=True)):
            try:
                a = self._dispatch(plan, strategy, docs.lengths)
            except DispatchError:
                continue
            t = assignment_seconds(a, plan) if plan is not None else None
            s = group.switch[current][k] if current is not None and current != k else 0.0
            if best is None or (t or 0.0) + s < best[0]:
                best = ((t or 0.0) + s, k, a, t, s)
        if best is None:
            return self._widened(step, docs, group)
        _, k, a, t, s = best
        return Choice(k, group.strategies[k], pack(docs, a, plan=k, predicted=t), t, s)

    def _widened(self, step: int, docs: DocumentStep, group: StrategySet) -> Choice:
        """A step that no strategy's fixed micro-batches take (whole documents leave gaps
        in rows, or too few documents are short enough for a short-row pipeline): the
        strategy of the longest maximum, first with ``f`` times the micro-batches (the
        least ``f`` that takes it: micro-batch counts change neither executables nor
        states), then only its pipelines of the longest rows (if two or more: every state
        keeps two holders), then every pipeline's rows at the longest."""
        k = max(range(len(group.strategies)), key=lambda i: _max_len(group.plans[i]))
        for plan, base in _fallbacks(group.plans[k], group.strategies[k]):
            for factor in range(1, len(docs.lengths) + 1):
                wide = Strategy(tuple(dataclasses.replace(p, num_micro_batches=p.num_micro_batches * factor)
                                      for p in base.pipelines))  # fmt: skip
                try:
                    a = self._dispatch(plan, wide, docs.lengths)
                except DispatchError:
                    continue
                t = assignment_seconds(a, plan) if plan is not None else None
                return Choice(k, wide, pack(docs, a, plan=k, predicted=t), t, 0.0)
        raise TrainError(
            f"step {step}: its {len(docs.lengths)} documents ({sum(docs.lengths)} tokens, "
            f"longest {max(docs.lengths)}) fit no strategy of the set for the ranks left: "
            "lower --tokens-per-step or raise --max-seq-len"
        )

    def _dispatch(
        self, plan: LengthStrategy | None, strategy: Strategy, lengths: Any
    ) -> Assignment:
        slots = [(p.num_micro_batches, p.micro_batch_size) for p in strategy.pipelines]
        multiple = length_multiple(
            strategy, sequence_parallel=self.config.options.sequence_parallel
        )
        run = balanced if plan is None else fixed_dispatcher(plan)
        return run(lengths, slots=slots, max_len=self.config.batch.seq_len, multiple=multiple)

    def samples(self) -> list[list[int]]:
        """The document lengths of the run's first ``SAMPLE_STEPS`` steps (the planner's
        length statistics and sample steps; read once, from a stream of their own)."""
        if self._samples is None:
            stream = step_documents(self.config, min_documents=self.floor)
            self._samples = [list(s.lengths) for s in islice(stream, SAMPLE_STEPS)]
        return self._samples

    def replan_record(self, *, members: tuple[int, ...], joined: tuple[int, ...],
                      alive: list[int]) -> dict[str, Any]:  # fmt: skip
        """Rank 0: the set for ``alive`` (the old generation's numbers, ``joined`` spares
        after them), warm-started from the set running now, as a plans file; any model with
        a cost function (a preset's formulas, a captured model's measured figures:
        ``planning_model``). A strategy in the record is a value: ``hspmd.train.elastic``
        encodes it for the store."""
        config = self.config
        slow = {
            r: slowdown_of(config.faults.slowdown, m).factor for r, m in enumerate(members + joined)
        }
        cost = local_cost(len(members) + len(joined), slowdown=slow, dtype=config.options.dtype)
        model = planning_model(config.model_config())
        planner = LengthPlanner(model, cost, sequence_parallel=config.options.sequence_parallel)
        samples = self.samples()
        hist = Histogram.of([n for s in samples for n in s], max_len=config.batch.seq_len,
                            smallest=max(1, config.batch.seq_len >> (MAXIMA + 2)))  # fmt: skip
        known = [p for p in self.set.plans if p is not None]
        previous = LengthSet(tuple(known), tuple(alive), 0.0, 0) if known else None
        # steps may go over --tokens-per-step (a document a rank at least): plan the largest
        tokens = max([config.batch.step_tokens or 0, *(sum(x) for x in samples)])
        found = planner.plan(hist, alive=alive, step_tokens=tokens,
                             count=MAXIMA, samples=samples, previous=previous)  # fmt: skip
        plans = [dataclasses.replace(p, strategy=_explicit(p)) for p in found.plans]
        for p in plans:
            check_strategy(p.strategy, config.model_config(), options=config.options,
                           seq_len=config.batch.seq_len)  # fmt: skip
        switch = StatesSwitch(plans, model, cost).matrix()
        data = plans_json(plans, hist, model=config.model.source, cluster=cost.cluster.name,
                          step_tokens=config.batch.step_tokens or 0, switch=switch)  # fmt: skip
        return {"plans": data, "plan_seconds": found.plan_seconds}

    def take(self, record: dict[str, Any], *, step: int, renumbered: dict[int, int]) -> Strategy:
        """A published set (old numbers; its strategy decoded): kept pending in the new
        numbers; returns the strategy (old numbers) that ``step`` runs under it."""
        if "plans" not in record:  # the elastic planner's strategy alone
            strategy: Strategy = record["strategy"]
            moved = renumber_strategy(strategy, renumbered)
            self._pending = StrategySet((None,), (moved,), ((0.0,),))
            return strategy
        plans, switch = load_plans(record["plans"], "the re-planned set")
        matrix = tuple(map(tuple, switch))
        old = StrategySet(tuple(plans), tuple(p.strategy for p in plans), matrix)
        chosen = self.choose(step, None, of=old)
        renumbered_plans = tuple(
            dataclasses.replace(p, strategy=renumber_strategy(p.strategy, renumbered))
            for p in plans
        )
        self._pending = StrategySet(
            renumbered_plans, tuple(p.strategy for p in renumbered_plans), matrix
        )
        return chosen.strategy

    def pending_strategies(self) -> tuple[Strategy, ...]:
        """The strategies of the set ``take`` kept (new numbers)."""
        return self._pending.strategies if self._pending is not None else ()

    def commit(self) -> None:
        """Adopt the set ``take`` kept (with the recovery's state)."""
        if self._pending is not None:
            self.set, self._pending = self._pending, None


def _fallbacks(
    plan: LengthStrategy | None, strategy: Strategy
) -> list[tuple[LengthStrategy | None, Strategy]]:
    """``_widened``'s variants of a strategy: itself, its longest-row pipelines alone
    (two or more), all its pipelines with rows of the longest."""
    if plan is None:
        return [(None, strategy)]
    out: list[tuple[LengthStrategy | None, Strategy]] = [(plan, strategy)]
    top = max(p.row_len for p in plan.pipes)
    keep = [i for i, p in enumerate(plan.pipes) if p.row_len == top]
    if 2 <= len(keep) < len(plan.pipes):
        sub = Strategy(tuple(strategy.pipelines[i] for i in keep))
        pipes = tuple(plan.pipes[i] for i in keep)
        intervals = tuple(plan.intervals[i] for i in keep)
        out.append((dataclasses.replace(plan, pipes=pipes, intervals=intervals, strategy=sub), sub))
    rows = tuple(dataclasses.replace(p, row_len=top) for p in plan.pipes)
    out.append((dataclasses.replace(plan, pipes=rows), strategy))
    return out


def _max_len(plan: LengthStrategy | None) -> int:
    return plan.max_len if plan is not None else 0


def _explicit(plan: LengthStrategy) -> Strategy:
    """``plan``'s strategy with every stage's recompute written out (``:RC<k>``, ``:RC0``):
    its text alone says how it runs, whatever the run's flags."""
    return Strategy(tuple(
        dataclasses.replace(pipe, stages=tuple(
            dataclasses.replace(st, recompute=st.recomputed(plan.options)) for st in pipe.stages))
        for pipe in plan.strategy.pipelines
    ))  # fmt: skip
