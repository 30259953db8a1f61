"""The homogeneous baseline: Megatron's DP x TP x PP over every rank, even layers.

Every (TP, PP, DP) that divides the cluster and the model, each micro-batch size that
divides the batch, recompute off and on, ranks in Megatron's order (TP fastest, then DP,
then PP) or pipeline-major; ranked by the 1F1B formula, the best simulated
(``hspmd.planner.predict``) and the fastest within the memory headroom kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Literal

from hspmd.cost.lines import CostModel
from hspmd.cost.stage import trains_sequence_parallel
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import Pipeline, Stage, Strategy, StrategyOptions
from hspmd.planner.closed_form import (
    MICRO_BATCH_SIZES,
    StageCosts,
    Unit,
    fastest_fitting,
    split_evenly,
    tp_degrees,
    within_headroom,
)
from hspmd.planner.predict import Prediction, predict

__all__ = ["homogeneous_plan", "megatron_strategy"]

Zero1 = Literal["auto", "on", "off"]


def megatron_strategy(
    dp: int, tp: int, pp: int, num_layers: int, m: int, mbs: int, *, pipeline_major: bool
) -> Strategy:
    """DP x TP x PP, even layers (first stages take the remainder), Megatron's rank order
    (TP fastest, then DP, then PP) or pipeline-major."""
    layout = _stage_ranks(dp, tp, pp, num_layers, pipeline_major=pipeline_major)
    return Strategy(tuple(_pipeline(stages, m, mbs) for stages in layout))


# one pipeline's stages: (ranks, first layer, last layer) each
StageRanks = tuple[tuple[tuple[int, ...], int, int], ...]


def _stage_ranks(
    dp: int, tp: int, pp: int, num_layers: int, *, pipeline_major: bool
) -> list[StageRanks]:
    """``megatron_strategy``'s stages, per pipeline."""
    counts = sorted(split_evenly(num_layers, pp), reverse=True)
    out = []
    for d in range(dp):
        stages, first = [], 0
        for s, n in enumerate(counts):
            base = (d * pp + s) * tp if pipeline_major else (s * dp + d) * tp
            stages.append((tuple(range(base, base + tp)), first, first + n - 1))
            first += n
        out.append(tuple(stages))
    return out


def _pipeline(stages: StageRanks, m: int, mbs: int) -> Pipeline:
    return Pipeline(m, mbs, tuple(Stage(ranks, a, b) for ranks, a, b in stages))


def homogeneous_plan(
    config: ModelSpec, cost: CostModel, *, global_batch: int, seq_len: int,
    zero1: Zero1 = "auto", dtype: Literal["bf16", "fp32"] = "bf16", keep: int = 2,
) -> Prediction | None:  # fmt: skip
    """The best Megatron-style plan over every rank, or None when none fits.

    Candidates are ranked by the closed form on one pipeline of each distinct cost
    (``_distinct``: at 65,536 ranks most layouts have one), and only those simulated are
    built whole."""
    n = cost.num_ranks
    node_sizes = [g.gpus_per_node for g in cost.cluster.groups]
    costs = StageCosts(cost, config, seq_len)
    sp_ok = trains_sequence_parallel(config)
    scored: list[tuple[float, int, tuple[int, int, int, int, int, bool], StrategyOptions]] = []
    serial = itertools.count()
    for tp in tp_degrees(config, node_sizes):
        for pp in range(1, min(config.num_layers, n // tp) + 1):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            distinct = {
                major: _distinct(_stage_ranks(dp, tp, pp, config.num_layers,
                                              pipeline_major=major), costs)
                for major in (False, True)
            }  # fmt: skip
            for mbs in MICRO_BATCH_SIZES:
                if global_batch % (dp * mbs):
                    continue
                m = global_batch // (dp * mbs)
                for recompute in (False, True):
                    options = StrategyOptions(
                        zero=int(zero1 == "on" or (zero1 == "auto" and dp > 1)),
                        sequence_parallel=tp > 1 and seq_len % tp == 0 and sp_ok,
                        recompute=recompute,
                        dtype=dtype,
                    )  # fmt: skip
                    for major in (False, True):
                        pipes = [_pipeline(stages, m, mbs) for stages in distinct[major]]
                        seconds = _closed_form(pipes, dp, costs, options)
                        scored.append((seconds, next(serial), (dp, tp, pp, m, mbs, major), options))
    scored.sort(key=lambda x: x[:2])
    predictions = []
    for _, _, (dp, tp, pp, m, mbs, major), options in scored:
        strategy = megatron_strategy(dp, tp, pp, config.num_layers, m, mbs, pipeline_major=major)
        p = predict(strategy, config, cost, seq_len=seq_len, options=options)
        if within_headroom(p, cost):
            predictions.append(p)
            if len(predictions) >= keep:
                break
    return fastest_fitting(predictions, cost)


def _distinct(layout: list[StageRanks], costs: StageCosts) -> list[StageRanks]:
    """One pipeline of ``layout`` per distinct closed-form cost: per stage, what its costs
    read of its ranks (``StageCosts.kinds``), and its layers."""
    found: dict[tuple[object, ...], StageRanks] = {}
    for stages in layout:
        key = tuple((costs.kinds(ranks), a, b) for ranks, a, b in stages)
        found.setdefault(key, stages)
    return list(found.values())


def _closed_form(
    pipelines: Iterable[Pipeline], d: int, costs: StageCosts, options: StrategyOptions
) -> float:
    """The 1F1B formula: the slowest of ``pipelines`` (of ``d``; used to rank candidates
    before simulating)."""
    worst = 0.0
    for pipe in pipelines:
        count = len(pipe.stages)
        times, units = [], []
        for s, stage in enumerate(pipe.stages):
            w = costs.work(stage.ranks, len(stage.layers), pipe.micro_batch_size, s == 0,
                           s == count - 1, options.recompute, options.sequence_parallel)  # fmt: skip
            times.append(w.forward_s + w.backward_s)
            units.append(Unit(costs.cost.kind_of(stage.ranks[0]), stage.ranks, 0))
        t = (pipe.num_micro_batches - 1) * max(times) + sum(times)
        t += costs.sync(units, [len(st.layers) for st in pipe.stages], d, options)
        worst = max(worst, t)
    return worst
