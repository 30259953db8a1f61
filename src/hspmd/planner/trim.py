"""Recompute only where memory needs it: per stage, the fewest layers that fit.

The search costs a layout with recompute off and, where that does not fit, with every
layer of every stage recomputed. Memory differs between stages, though: 1F1B keeps more
micro-batches in flight on the first stages, the last one holds the logits, and stages of
a small-memory GPU kind or of low TP degree fill up before the others. ``trim_recompute``
gives each stage of such a plan the least count ``k`` of its first layers to recompute
(``:RC<k>`` in the strategy; ``hspmd.plan.strategy``) with which each of its ranks' peak
(``hspmd.planner.memory.rank_memory``) stays within its device's memory less
``PLAN_HEADROOM``; a stage that fits without any keeps everything (``:RC0``: every stage
says its count where they differ, ``uniform_recompute``).

>>> from hspmd.models.config import get_config
>>> from hspmd.cost.lines import CostModel
>>> from hspmd.cost.cluster import load_cluster
>>> config, cost = get_config("llama-32b"), CostModel.of(load_cluster("h200x8"))
>>> strategy = parse_strategy("8x1: R0-1:L0-14 R2-3:L15-29 R4-5:L30-44 R6-7:L45-59")
>>> options = StrategyOptions(recompute=True, sequence_parallel=True, dtype="bf16")
>>> trimmed, opts = trim_recompute(strategy, config, cost, seq_len=16384, options=options)
>>> str(trimmed), opts.recompute
('8x1: R0-1:L0-14:RC7 R2-3:L15-29:RC3 R4-5:L30-44:RC0 R6-7:L45-59:RC0', True)
"""

from __future__ import annotations

from dataclasses import replace

from hspmd.cost.lines import CostModel
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import (  # noqa: F401
    Strategy,
    StrategyOptions,
    parse_strategy,
    uniform_recompute,
)
from hspmd.planner.closed_form import PLAN_HEADROOM
from hspmd.planner.memory import stage_memory, stage_places

__all__ = ["trim_recompute"]


def trim_recompute(
    strategy: Strategy, config: ModelSpec, cost: CostModel, *, seq_len: int,
    options: StrategyOptions,
) -> tuple[Strategy, StrategyOptions]:  # fmt: skip
    """``strategy`` with each stage recomputing the fewest first layers that fit (module
    docstring) and its options (``uniform_recompute``); both unchanged where ``options``
    does not recompute, or where every stage needs all its recomputed layers."""
    if not options.recompute:
        return strategy, options
    plain = replace(options, recompute=False, recompute_layers=0)
    cache: dict[tuple[object, ...], int] = {}
    counts: dict[tuple[int, int], int] = {}
    places = stage_places(strategy, config.num_layers, options.schedule, shares=options.zero_shares)
    for p, s, stage, place in places:
        before = stage.recomputed(options)
        cap = min(cost.device_of(r).memory_bytes for r in stage.ranks) * (1 - PLAN_HEADROOM)
        key = (stage.tp, stage.cp, len(stage.layers), place, cap, before)
        if key not in cache:  # stages alike in all their memory reads: one search
            fits = (
                k for k in range(len(stage.layers) + 1)
                if stage_memory(config, stage, place, seq_len=seq_len, options=plain,
                                recomputed=k).peak <= cap
            )  # fmt: skip
            cache[key] = next(fits, before)
        counts[(p, s)] = cache[key]
    if all(counts[(p, s)] == st.recomputed(options) for p, s, st in strategy.stages()):
        return strategy, options
    pipelines = tuple(
        replace(pipe, stages=tuple(
            replace(st, recompute=counts[(p, s)] or None) for s, st in enumerate(pipe.stages)
        ))
        for p, pipe in enumerate(strategy.pipelines)
    )  # fmt: skip
    return uniform_recompute(Strategy(pipelines), plain)
