"""Choosing a length strategy on sampled steps, among the DP's and the homogeneous ones.

The DP (``hspmd.planner.lengths``) works on expected values: each interval's tokens spread
evenly over its pipelines. Real steps have few long documents, which do not split between
pipelines, and fixed micro-batches that must each get a document. So, given sample steps
(lists of document lengths, e.g. the corpus's first steps), ``plan_strategies`` keeps for
each maximum length the candidate with the least mean predicted time on the samples it
would serve, dispatched as training dispatches them (``fixed_dispatcher``): the DP's
results and every homogeneous strategy (``homogeneous_strategies``). The homogeneous
baselines of ``benchmarks/mixed_length.py`` are built by the same function.

>>> from hspmd.planner.length_model import PipeConfig, PipeModel
>>> m = PipeModel(PipeConfig(1, 1), o=0.0, a=1.0, q=0.0, send_o=0.0, send_a=0.0, fit_len=64)
>>> [str(p.strategy) for p in homogeneous_strategies([m], gpus=2, row_len=64, step_tokens=128)]
['2x1: R0:L0-0; 2x1: R1:L0-0']
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace

from hspmd.cost.lines import CostModel
from hspmd.models.spec import ModelSpec
from hspmd.plan.dispatch import DispatchError
from hspmd.plan.strategy import StrategyOptions, uniform_recompute
from hspmd.planner.length_dispatch import assignment_seconds, fixed_dispatcher
from hspmd.planner.length_model import (
    LengthStrategy,
    PipeModel,
    PipeSpec,
    sync_seconds,
    to_strategy,
)

__all__ = ["FINALISTS", "homogeneous_strategies", "pick", "sampled_seconds"]

FINALISTS = 6  # candidates scored on every sample, after a first cut on three


def homogeneous_strategies(
    models: Sequence[PipeModel], *, gpus: int, row_len: int, step_tokens: int,
    config: ModelSpec | None = None, cost: CostModel | None = None,
    options: StrategyOptions | None = None, replicas: int | None = None,
) -> list[LengthStrategy]:  # fmt: skip
    """Every strategy of ``gpus // size`` equal pipelines of one of ``models`` (``replicas``:
    only those of that many pipelines, the ZeRO-1 count their memory assumed) with rows of
    ``row_len`` and, per pipeline, the rows a step's tokens need plus one (as the DP)."""
    out = []
    for m in models:
        n = gpus // m.config.gpus
        if not n or gpus % m.config.gpus or m.fit_len < row_len or replicas not in (None, n):
            continue
        micro = math.ceil(step_tokens / (n * row_len)) + 1
        pipes = tuple(PipeSpec(m, row_len, micro) for _ in range(n))
        layers = config.num_layers if config is not None else 1
        strategy, opts = uniform_recompute(to_strategy(pipes, layers), options or StrategyOptions())
        sync = 0.0
        if config is not None and cost is not None:
            sync = sync_seconds(strategy, config, cost, zero1=opts.zero1)
        out.append(LengthStrategy(row_len, pipes, ((1, row_len),) * n, 0.0, sync, strategy,
                                  opts))  # fmt: skip
    return out


def sampled_seconds(
    plan: LengthStrategy, samples: Sequence[Sequence[int]], *, strict: bool = False
) -> float:
    """Mean predicted step time of ``plan`` over the ``samples`` it can take, dispatched
    into its fixed micro-batches (inf if none; with ``strict``, if any one does not fit:
    a run's only strategy must take every step)."""
    run = fixed_dispatcher(plan)
    slots = [(p.micro_batches, 1) for p in plan.pipes]
    times = []
    for lengths in samples:
        if not lengths or max(lengths) > plan.max_len:
            continue
        try:
            a = run(lengths, slots=slots, max_len=plan.max_len)
        except DispatchError:
            if strict:
                return math.inf
            continue
        times.append(assignment_seconds(a, plan))
    if strict and len(times) < len(samples):
        return math.inf
    return statistics.mean(times) if times else math.inf


def pick(
    candidates: Sequence[LengthStrategy],
    samples: Sequence[Sequence[int]],
    *,
    low: int,
) -> LengthStrategy | None:
    """The candidate with the least mean predicted time on the samples whose longest
    document is over ``low`` (the steps a strategy for this maximum serves; all that fit
    if there are none), that mean as its ``predicted_s`` (the homogeneous candidates carry
    none of their own); None if no candidate takes any."""
    fit = [s for s in samples if s and max(s) <= candidates[0].max_len]
    served = [s for s in fit if max(s) > low] or fit
    if not served:
        return None
    # rank every candidate on a few samples, then the best few on all of them
    few = sorted(range(len(candidates)), key=lambda i: sampled_seconds(candidates[i], served[:3]))
    scored = [(sampled_seconds(candidates[i], served), i) for i in few[:FINALISTS]]
    seconds, index = min(scored)
    return replace(candidates[index], predicted_s=seconds) if seconds < math.inf else None
