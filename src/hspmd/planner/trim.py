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
>>> from hspmd.planner.cost import CostModel
>>> from hspmd.switch.cluster import load_cluster
>>> config, cost = get_config("llama-32b"), CostModel.of(load_cluster("h200x8"))
>>> strategy = parse_strategy("8x1: R0-1:L0-14 R2-3:L15-29 R4-5:L30-44 R6-7:L45-59")
>>> options = StrategyOptions(recompute=True, sequence_parallel=True, dtype="bf16")
>>> trimmed, opts = trim_recompute(strategy, config, cost, seq_len=16384, options=options)
>>> str(trimmed), opts.recompute
('8x1: R0-1:L0-14:RC7 R2-3:L15-29:RC3 R4-5:L30-44:RC0 R6-7:L45-59:RC0', True)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import (  # noqa: F401
    Stage,
    Strategy,
    StrategyOptions,
    parse_strategy,
    uniform_recompute,
)
from hspmd.planner.closed_form import PLAN_HEADROOM
from hspmd.planner.cost import CostModel
from hspmd.planner.memory import in_flight, layer_holders, rank_memory

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
    holders = layer_holders(strategy, config.num_layers)
    cache: dict[tuple[object, ...], int] = {}
    pipelines, changed = [], False
    for pipeline in strategy.pipelines:
        count, stages = len(pipeline.stages), []
        for i, stage in enumerate(pipeline.stages):
            before = stage.recomputed(options)
            cap = min(cost.device_of(r).memory_bytes for r in stage.ranks) * (1 - PLAN_HEADROOM)
            at = _Where(
                first=i == 0, last=i == count - 1,
                flight=in_flight(options.schedule, count, i, pipeline.num_micro_batches),
                mbs=pipeline.micro_batch_size,
                replicas=min(holders[layer] for layer in stage.layers),
            )  # fmt: skip
            key = (stage.tp, stage.cp, len(stage.layers), at, cap, before)
            if key not in cache:
                fits = (
                    k for k in range(len(stage.layers) + 1)
                    if _peak(config, stage, at, seq_len, plain, k) <= cap
                )  # fmt: skip
                cache[key] = next(fits, before)
            k = cache[key]
            changed |= k != before
            stages.append(replace(stage, recompute=k or None))
        pipelines.append(replace(pipeline, stages=tuple(stages)))
    if not changed:
        return strategy, options
    return uniform_recompute(Strategy(tuple(pipelines)), plain)


@dataclass(frozen=True, slots=True)
class _Where:
    """A stage's place in its pipeline, as its memory reads it."""

    first: bool
    last: bool
    flight: int  # micro-batches in flight
    mbs: int
    replicas: int  # ZeRO-1's


def _peak(
    config: ModelSpec, stage: Stage, at: _Where, seq_len: int, options: StrategyOptions, k: int
) -> float:
    return rank_memory(
        config, rank=stage.ranks[0], tp=stage.tp, num_layers=len(stage.layers), first=at.first,
        last=at.last, in_flight_micro_batches=at.flight, micro_batch_size=at.mbs,
        seq_len=seq_len, replicas=at.replicas, options=options, cp=stage.cp, recomputed=k,
    ).peak  # fmt: skip
