"""Per step: the dispatch of a step's documents into a length strategy's pipelines and
rows, its predicted time, and the choice of the strategy (``hspmd.planner.lengths``).

- ``dispatch``: documents longest first, each to the pipeline that may hold it (its row
  length is at least the document) whose predicted time after taking it is least, into
  its fullest row the document fits (best fit), or a new row;
- ``fixed_dispatcher``: the same into a strategy's fixed micro-batches (training);
- ``choose``: every strategy whose maximum holds the step's longest document, its
  dispatched time plus the switch from the strategy running now; the least wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from hspmd.cost.lines import CostModel
from hspmd.models.spec import ModelSpec
from hspmd.plan.dispatch import Assignment, DispatchError
from hspmd.plan.strategy import Strategy
from hspmd.planner.length_model import LengthPlanError, LengthStrategy, PipeSpec

__all__ = [
    "Rows",
    "assignment_seconds",
    "choose",
    "dispatch",
    "fixed_dispatcher",
    "step_seconds",
    "switch_seconds",
]


class Rows:
    """One pipeline's rows during dispatch: ``(tokens, squares)`` and the documents."""

    def __init__(self, spec: PipeSpec) -> None:
        self.spec = spec
        self.rows: list[list[float]] = []  # [tokens, squares]
        self.docs: list[list[int]] = []

    def seconds(self) -> float:
        return self.spec.model.seconds([(r[0], r[1]) for r in self.rows])

    def place(self, n: int) -> int:
        """The row for a document of ``n`` tokens: the fullest it fits, else a new one."""
        best, used = -1, -1.0
        for i, r in enumerate(self.rows):
            if r[0] + n <= self.spec.row_len and r[0] > used:
                best, used = i, r[0]
        return best

    def with_doc(self, n: int) -> float:
        """The time after taking a document of ``n`` tokens (nothing changes)."""
        i = self.place(n)
        rows = [(r[0], r[1]) for r in self.rows]
        if i < 0:
            rows.append((n, float(n) * n))
        else:
            rows[i] = (rows[i][0] + n, rows[i][1] + float(n) * n)
        return self.spec.model.seconds(rows)

    def add(self, index: int, n: int) -> None:
        i = self.place(n)
        if i < 0:
            self.rows.append([0.0, 0.0])
            self.docs.append([])
            i = len(self.rows) - 1
        self.rows[i][0] += n
        self.rows[i][1] += float(n) * n
        self.docs[i].append(index)


def dispatch(lengths: Sequence[int], plan: LengthStrategy) -> list[Rows]:
    """Each document of a step, longest first, to the pipeline that may hold it whose time
    after taking it is least (module docstring, 4); rows as many as needed."""
    pipes = [Rows(spec) for spec in plan.pipes]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        fits = [p for p in pipes if p.spec.row_len >= n]
        if not fits:
            raise LengthPlanError(
                f"a document of {n} tokens is longer than every pipeline of the strategy for "
                f"{plan.max_len}: truncate it (--long-docs truncate) or plan a longer maximum"
            )
        min(fits, key=lambda p: p.with_doc(n)).add(i, n)
    return pipes


def step_seconds(pipes: Sequence[Rows], plan: LengthStrategy) -> float:
    """A dispatched step's predicted time: the slowest pipeline, then the sync."""
    return max(p.seconds() for p in pipes) + plan.sync_s


def choose(
    lengths: Sequence[int], plans: Sequence[LengthStrategy], *, current: int | None,
    switch: Callable[[int, int], float],
) -> tuple[int, float, float]:  # fmt: skip
    """``(plan index, predicted step seconds, switch seconds)`` of the best strategy for a
    step: the least dispatched step time plus the switch from ``current``."""
    longest = max(lengths)
    best: tuple[float, int, float, float] | None = None
    for k, plan in enumerate(plans):
        if plan.max_len < longest:
            continue
        t = step_seconds(dispatch(lengths, plan), plan)
        s = switch(current, k) if current is not None and current != k else 0.0
        if best is None or t + s < best[0]:
            best = (t + s, k, t, s)
    if best is None:
        raise LengthPlanError(
            f"a document of {longest} tokens is longer than every strategy's maximum "
            f"({max(p.max_len for p in plans)}): truncate it or plan a longer --max-seq-len"
        )
    return best[1], best[2], best[3]


def switch_seconds(a: Strategy, b: Strategy, config: ModelSpec, cost: CostModel) -> float:
    """The fused BSR of the bf16 compute weights ``a -> b`` (``--switch-mode weights``)."""
    from hspmd.plan.params import state_annotations
    from hspmd.switch.cost import STATES, estimate_scheme, switch_tables

    tables = switch_tables(state_annotations(a, config), state_annotations(b, config),
                           itemsize=STATES["bf16"], failed=set())  # fmt: skip
    return float(estimate_scheme(tables, "fused", topology=cost.cluster.topology()).time)


def fixed_dispatcher(plan: LengthStrategy) -> Callable[..., Assignment]:
    """A ``plan.dispatch`` dispatcher into ``plan.strategy``'s fixed micro-batches (one row
    each): documents longest first, each to the pipeline whose row length holds it and
    whose predicted time after taking it is least, into its least loaded micro-batch that
    holds it; the last documents go to pipelines still without one. A micro-batch may
    stay empty (length 0: the runtime skips it); a pipeline may not."""

    def run(
        lengths: Sequence[int], *, slots: Sequence[tuple[int, int]], max_len: int,
        multiple: int = 1,
    ) -> Assignment:  # fmt: skip
        caps = [min(spec.row_len, max_len) for spec in plan.pipes]
        if len(slots) != len(caps) or any(r != 1 for _, r in slots):
            raise DispatchError(
                f"slots {list(slots)} are not the plan's {len(caps)} pipelines x 1 row"
            )
        load = [[[0.0, 0.0] for _ in range(m)] for m, _ in slots]
        out: list[tuple[int, int, int]] = [(-1, -1, -1)] * len(lengths)
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        for k, i in enumerate(order):
            idle = [all(r[0] == 0 for r in pipe) for pipe in load]
            must_fill = len(order) - k <= sum(idle)
            p, m = _place(plan, load, caps, lengths[i], only=idle if must_fill else None)
            load[p][m][0] += lengths[i]
            load[p][m][1] += float(lengths[i]) ** 2
            out[i] = (p, m, 0)
        idle_pipes = [p for p, pipe in enumerate(load) if all(r[0] == 0 for r in pipe)]
        if idle_pipes:
            raise DispatchError(
                f"{len(lengths)} documents leave pipeline {idle_pipes[0]} without one: a "
                f"step needs at least one document per pipeline ({len(load)})"
            )
        packed = tuple(
            tuple(math.ceil(int(r[0]) / multiple) * multiple for r in pipe) for pipe in load
        )
        return Assignment(
            tuple(out), packed, tuple(1 for _ in slots), tuple(int(n) for n in lengths)
        )

    return run


def _place(
    plan: LengthStrategy, load: list[list[list[float]]], caps: Sequence[int], n: int, *,
    only: Sequence[bool] | None,
) -> tuple[int, int]:  # fmt: skip
    """``(pipeline, micro-batch)`` for a document of ``n`` tokens: of the pipelines that
    hold it (``only``: among those flagged), the least predicted time after taking it,
    in its least loaded micro-batch that holds it."""
    best: tuple[float, int, int] | None = None
    for p, pipe in enumerate(load):
        if caps[p] < n or (only is not None and not only[p]):
            continue
        fits = [m for m, r in enumerate(pipe) if r[0] + n <= caps[p]]
        if not fits:
            continue
        m = min(fits, key=lambda m: (pipe[m][0] > 0, pipe[m][0], m))
        rows = [(r[0], r[1]) for r in pipe]
        rows[m] = (rows[m][0] + n, rows[m][1] + float(n) * n)
        t = plan.pipes[p].model.seconds(rows)
        if best is None or t < best[0]:
            best = (t, p, m)
    if best is None:
        raise DispatchError(
            f"a document of {n} tokens fits no micro-batch of the plan for {plan.max_len}: "
            "lower the tokens per step"
        )
    return best[1], best[2]


def assignment_seconds(a: Assignment, plan: LengthStrategy) -> float:
    """The predicted time of a step as ``a`` packs it into ``plan``'s pipelines."""
    rows: list[dict[tuple[int, int], list[float]]] = [{} for _ in plan.pipes]
    for (p, m, r), n in zip(a.slots, a.doc_lengths, strict=True):
        row = rows[p].setdefault((m, r), [0.0, 0.0])
        row[0] += n
        row[1] += float(n) * n
    times = [
        spec.model.seconds([(x[0], x[1]) for x in pipe.values()])
        for spec, pipe in zip(plan.pipes, rows, strict=True)
    ]
    return max(times) + plan.sync_s
