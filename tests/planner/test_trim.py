"""Per-stage recompute: the least count of recomputed layers that fits each stage."""

from __future__ import annotations

from dataclasses import replace

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.config import get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.planner.closed_form import PLAN_HEADROOM
from hspmd.planner.memory import strategy_memory
from hspmd.planner.predict import predict
from hspmd.planner.trim import trim_recompute

CONFIG = get_config("llama-32b")
COST = CostModel.of(load_cluster("h200x8"))
PP4 = parse_strategy("8x1: R0-1:L0-14 R2-3:L15-29 R4-5:L30-44 R6-7:L45-59")
ALL = StrategyOptions(recompute=True, sequence_parallel=True, dtype="bf16")
SEQ = 16384


def _fits(strategy, options) -> bool:  # type: ignore[no-untyped-def]
    cap = COST.device_of(0).memory_bytes * (1 - PLAN_HEADROOM)
    memory = strategy_memory(strategy, CONFIG, seq_len=SEQ, options=options)
    return all(m.peak <= cap for m in memory.values())


def test_each_stage_recomputes_the_least_that_fits() -> None:
    trimmed, plain = trim_recompute(PP4, CONFIG, COST, seq_len=SEQ, options=ALL)
    counts = trimmed.recomputed(plain)[0]
    # every stage says its count (:RC0 where none): the options alone err towards recompute
    assert all(st.recompute is not None for st in trimmed.pipelines[0].stages)
    assert plain.recompute and _fits(trimmed, plain)
    # 1F1B: the first stage holds the most micro-batches in flight, so recomputes the most
    assert list(counts) == sorted(counts, reverse=True) and counts[0] > 0
    for s, k in enumerate(counts):  # one layer less on any stage that recomputes: too much
        if k:
            stages = list(trimmed.pipelines[0].stages)
            stages[s] = replace(stages[s], recompute=k - 1)
            fewer = replace(
                trimmed, pipelines=(replace(trimmed.pipelines[0], stages=tuple(stages)),)
            )
            assert not _fits(fewer, plain), s


def test_trimming_is_faster_than_recomputing_everything() -> None:
    trimmed, plain = trim_recompute(PP4, CONFIG, COST, seq_len=SEQ, options=ALL)
    before = predict(PP4, CONFIG, COST, seq_len=SEQ, options=ALL).step_time_s
    after = predict(trimmed, CONFIG, COST, seq_len=SEQ, options=plain).step_time_s
    assert after < before


def test_nothing_to_trim_without_recompute_or_where_nothing_fits() -> None:
    plain = replace(ALL, recompute=False)
    assert trim_recompute(PP4, CONFIG, COST, seq_len=SEQ, options=plain) == (PP4, plain)
    # one stage at a long row: 47 of its 60 layers, written as options (every stage alike)
    one = parse_strategy("8x1: R0-7:L0-59")
    found, opts = trim_recompute(one, CONFIG, COST, seq_len=131072, options=ALL)
    assert (str(found), opts.recompute, opts.recompute_layers) == (str(one), True, 47)
    # 1M tokens do not fit even recomputing all: unchanged (the plan's memory check refuses it)
    assert trim_recompute(one, CONFIG, COST, seq_len=1 << 20, options=ALL) == (one, ALL)
