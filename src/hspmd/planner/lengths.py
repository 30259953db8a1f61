"""The length-aware planner: one heterogeneous strategy per maximum length, chosen per step.

Real corpora are long-tailed. From a histogram of document lengths (``Histogram``: bins at
powers of two up to the maximum length, with the count, tokens and squared lengths of
each) and the tokens per step ``N``:

1. **Micro-batch cost** (``PipeModel``): a pipeline of ``pp`` stages of ``tp`` ranks, layers
   split evenly, runs a packed micro-batch (one row of documents ``l_1..l_k``) on its
   slowest stage in ``o + a * sum(l) + q * sum(l^2)`` seconds forward and backward:
   ``hspmd.cost.stage.stage_work`` is exactly quadratic in the length (attention is
   ``s^2``), so three evaluations give ``o, a, q``. A step of rows ``t_1..t_m`` takes
   ``sum(t_i) + (pp - 1) * (max(t_i) + 2 * send)`` (1F1B: the fill and drain of the
   longest row). A configuration fits a row length when both end stages' memory
   (``planner.memory.rank_memory``, ``pp`` micro-batches in flight) is within the device.
2. **The DP** (``plan_lengths``): bins ``1..K`` in length order. ``f[j][g]`` is the best
   step time (the slowest pipeline) for the documents of bins ``1..j`` on ``g`` GPUs.
   ``f[j][g] = min over i <= j, configuration c, count n, row length R >= edge[j] of
   max(f[i-1][g - n * gpus(c)], T(bins i..j on n pipelines c with rows of R))`` where
   ``T`` spreads the interval's expected tokens and squares evenly over the ``n``
   pipelines and packs them into rows of ``R``. The answer is ``min_g f[K][g]``, ``g <=``
   the cluster; walking back gives the intervals, each with its pipelines: one
   heterogeneous strategy whose short-length pipelines pack many short documents and
   whose long-length pipelines hold the long ones.
3. **Several strategies** (``plan_strategies``): the DP again on the histogram cut at each
   smaller maximum (the steps whose longest document is shorter), so a step without long
   documents runs a strategy without long-length pipelines. Recompute is per pipeline:
   the configurations of every option set (recompute off, all, the first ``k`` layers)
   are one pool, so a long-row pipeline recomputes what its memory needs and the others
   do not (its stages carry ``:RC<k>``).
4. **Dispatch** (``dispatch``): a step's documents, longest first, each to the pipeline
   that may hold it (its row length is at least the document) whose predicted time after
   taking it is least, into its fullest row the document fits (best fit), or a new row.
   ``fixed_dispatcher`` does the same into a strategy's fixed micro-batches (training).
5. **Choice per step** (``choose``): every strategy whose maximum holds the step's longest
   document, its dispatch's predicted time plus the switch from the strategy running now
   (bf16 weights only, ``switch_seconds``); the least wins.

One GPU kind (mixed kinds: ``planner.search``). No torch here.

>>> h = Histogram.of([100] * 90 + [3000] * 10, max_len=4096, smallest=1024)
>>> h.edges, h.counts, h.tokens
((1024, 2048, 4096), (90, 0, 10), (9000, 0, 30000))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from hspmd.cost.lines import CostModel
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import StrategyOptions, uniform_recompute
from hspmd.planner.length_candidates import homogeneous_strategies, pick
from hspmd.planner.length_dispatch import (
    Rows,
    assignment_seconds,
    choose,
    dispatch,
    fixed_dispatcher,
    step_seconds,
    switch_seconds,
)
from hspmd.planner.length_model import (
    Histogram,
    LengthPlanError,
    LengthStrategy,
    PipeConfig,
    PipeModel,
    PipeSpec,
    ideal_seconds,
    pipe_configs,
    pipe_model,
    sync_seconds,
    to_strategy,
)
from hspmd.planner.length_plans import load_plans, plans_json, switch_matrix

__all__ = [
    "Histogram",
    "LengthPlanError",
    "LengthStrategy",
    "PipeConfig",
    "PipeModel",
    "PipeSpec",
    "Rows",
    "assignment_seconds",
    "choose",
    "dispatch",
    "fixed_dispatcher",
    "ideal_seconds",
    "load_plans",
    "option_sets",
    "pipe_configs",
    "pipe_model",
    "plan_lengths",
    "plan_strategies",
    "plans_json",
    "step_seconds",
    "switch_matrix",
    "switch_seconds",
    "sync_seconds",
    "to_strategy",
]


def _interval_seconds(
    model: PipeModel, n: int, row_len: int, docs: float, tokens: float, squares: float,
    longest: float = 0.0,
) -> float:  # fmt: skip
    """One of ``n`` pipelines' time on its share of an interval's expected documents, and
    at least the time of its ``longest`` document alone (a document is not split between
    pipelines: with few documents a step, the pipeline holding the longest one is the
    slowest, however evenly the tokens spread)."""
    x, s2, d = tokens / n, squares / n, docs / n
    if x <= 0:
        return 0.0
    rows = max(1, min(math.ceil(x / row_len), math.ceil(d)))
    spread = model.seconds([(x / rows, s2 / rows)] * rows)
    return max(spread, model.seconds([(longest, longest * longest)]) if longest else 0.0)


def _longest(hist: Histogram, per: Sequence[tuple[float, float, float]], j: int) -> float:
    """The length of the longest document that bins ``..j`` (0-based) give a step, where
    a step surely has one: the top bin of the histogram (the steps this strategy serves
    have their longest document there) or a bin with a document a step or more; its
    token-weighted mean length (0: no bound)."""
    docs, tokens, squares = per[j]
    if tokens <= 0 or (j < len(hist.edges) - 1 and docs < 1):
        return 0.0
    return squares / tokens


def plan_lengths(
    hist: Histogram, models: Sequence[PipeModel], *, gpus: int, step_tokens: int,
    config: ModelSpec | None = None, cost: CostModel | None = None,
    options: StrategyOptions | None = None,
) -> LengthStrategy:  # fmt: skip
    """The DP of the module docstring on ``hist`` over ``gpus`` GPUs: one heterogeneous
    strategy for steps of ``step_tokens`` tokens whose documents are at most
    ``hist.max_len``. With ``config`` and ``cost`` the result carries its hspmd
    ``Strategy`` (ranks numbered pipeline by pipeline, largest first) and its sync time."""
    K = len(hist.edges)
    per = [hist.per_step(k, step_tokens) for k in range(K)]
    f, back = _length_table(hist, models, per, gpus=gpus)
    best_g = min(range(gpus + 1), key=lambda g: (f[K][g], g))
    if f[K][best_g] == math.inf:
        raise LengthPlanError(
            f"no pipeline of {gpus} GPUs fits a row of {hist.max_len} tokens in memory: "
            "lower --max-seq-len or use a larger cluster"
        )
    pipes, intervals = _walk_back(hist, models, per, back, best_g)
    order = sorted(
        range(len(pipes)), key=lambda p: (-pipes[p].model.config.gpus, -pipes[p].row_len)
    )
    pipes = [pipes[p] for p in order]
    intervals = [intervals[p] for p in order]
    out = LengthStrategy(hist.max_len, tuple(pipes), tuple(intervals), f[K][best_g])
    if config is not None and cost is not None:
        strategy, opts = uniform_recompute(to_strategy(out.pipes, config.num_layers),
                                           options or StrategyOptions())  # fmt: skip
        sync = sync_seconds(strategy, config, cost, zero1=opts.zero1)
        out = LengthStrategy(out.max_len, out.pipes, out.intervals, out.predicted_s + sync,
                             sync, strategy, opts)  # fmt: skip
    return out


_Back = tuple[int, int, int, int, float]  # (i, model index, n, row_len, seconds)
_PerBin = Sequence[tuple[float, float, float]]  # per bin: (documents, tokens, squares) a step


def _length_table(
    hist: Histogram, models: Sequence[PipeModel], per: _PerBin, *, gpus: int
) -> tuple[list[list[float]], list[list[_Back | None]]]:
    """``f[j][g]``: the best step time of bins ``0..j-1`` on ``g`` GPUs; ``back[j][g]``: the
    last interval's choice that gives it (module docstring)."""
    K, edges, inf = len(hist.edges), hist.edges, math.inf
    f = [[inf] * (gpus + 1) for _ in range(K + 1)]
    back: list[list[_Back | None]] = [[None] * (gpus + 1) for _ in range(K + 1)]
    f[0][0] = 0.0
    for j in range(1, K + 1):
        for i in range(1, j + 1):
            docs = sum(per[k][0] for k in range(i - 1, j))
            tokens = sum(per[k][1] for k in range(i - 1, j))
            squares = sum(per[k][2] for k in range(i - 1, j))
            if tokens <= 0 and i < j:
                continue
            longest = _longest(hist, per, j - 1)
            for mi, model in enumerate(models):
                for row_len in edges[j - 1 :]:
                    if row_len > model.fit_len:
                        break
                    size = model.config.gpus
                    for n in range(1, gpus // size + 1):
                        t = _interval_seconds(model, n, row_len, docs, tokens, squares, longest)
                        for g0 in range(gpus - n * size + 1):
                            prev = f[i - 1][g0]
                            if prev == inf:
                                continue
                            value = max(prev, t)
                            g = g0 + n * size
                            if value < f[j][g] - 1e-12:
                                f[j][g] = value
                                back[j][g] = (i, mi, n, row_len, t)
    return f, back


def _walk_back(
    hist: Histogram, models: Sequence[PipeModel], per: _PerBin,
    back: list[list[_Back | None]], best_g: int,
) -> tuple[list[PipeSpec], list[tuple[int, int]]]:  # fmt: skip
    """The pipelines and length intervals of the table's best entry on ``best_g`` GPUs."""
    edges = hist.edges
    pipes: list[PipeSpec] = []
    intervals: list[tuple[int, int]] = []
    j, g = len(edges), best_g
    while j > 0:
        entry = back[j][g]
        assert entry is not None
        i, mi, n, row_len, _ = entry
        lo = 1 if i == 1 else edges[i - 2] + 1
        x = sum(per[k][1] for k in range(i - 1, j)) / n
        d = sum(per[k][0] for k in range(i - 1, j)) / n
        rows = max(1, min(math.ceil(x / row_len), math.ceil(d)))
        for _ in range(n):  # one micro-batch more than expected: room for fuller steps
            pipes.append(PipeSpec(models[mi], row_len, rows + 1))
            intervals.append((lo, edges[j - 1]))
        j, g = i - 1, g - n * models[mi].config.gpus
    return pipes, intervals


def plan_strategies(
    config: ModelSpec, cost: CostModel, hist: Histogram, *, step_tokens: int,
    options: Sequence[StrategyOptions], count: int = 4,
    samples: Sequence[Sequence[int]] = (),
) -> list[LengthStrategy]:  # fmt: skip
    """One strategy per maximum length: ``hist``'s last ``count`` edges (each the DP on
    the histogram cut there, under each of ``options``), shortest maximum first;
    duplicates dropped. Under ZeRO-1 the DP runs once per replica count ``z`` (1, 2, 4,
    ...: memory with states sharded ``z`` ways) and keeps results of at least ``z``
    pipelines. Without ``samples`` the DP result predicted fastest is kept; with sample
    steps (lists of document lengths) the candidate fastest on the samples it would serve,
    among the DP's results and every homogeneous strategy (``planner.length_candidates``)."""
    pools = []  # per ZeRO-1 replica count: every option set's configurations in one pool
    for o, group in _by_recompute(options).items():
        for z in _powers(cost.num_ranks) if o.zero1 else (1,):
            every = [m for g in group for m in pipe_configs(config, cost, options=g,
                                                            max_len=hist.max_len, replicas=z)]  # fmt: skip
            pools.append((o, z, _undominated(every)))
    if not any(models for _, _, models in pools):
        raise LengthPlanError(
            f"no TP x PP pipeline of at most {cost.num_ranks} GPUs fits {config.num_layers} "
            f"layers in {cost.device_of(0).memory_bytes / 2**30:.0f} GiB a GPU: use a larger "
            "cluster or --recompute"
        )
    out: list[LengthStrategy] = []
    first = max(0, len(hist.edges) - count)
    for k in range(first, len(hist.edges)):
        if k < len(hist.edges) - 1 and not hist.counts[k] and not any(hist.counts[k + 1 :]):
            continue
        found = []
        for opts, z, models in pools:
            try:
                plan = plan_lengths(hist.upto(k), models, gpus=cost.num_ranks,
                                    step_tokens=step_tokens, config=config, cost=cost,
                                    options=opts)  # fmt: skip
            except LengthPlanError:
                continue
            if len(plan.pipes) >= z:
                found.append(plan)
        if not found:
            if k == len(hist.edges) - 1:
                raise LengthPlanError(
                    f"no pipeline of {cost.num_ranks} GPUs fits a row of {hist.max_len} "
                    "tokens in memory: lower --max-seq-len or use a larger cluster"
                )
            continue
        plan = min(found, key=lambda p: p.predicted_s)
        if samples:
            low = hist.edges[k - 1] if k else 0
            homs = [h for o, z, models in pools for h in homogeneous_strategies(
                models, gpus=cost.num_ranks, row_len=hist.edges[k], step_tokens=step_tokens,
                config=config, cost=cost, options=o, replicas=z if o.zero1 else None)]  # fmt: skip
            plan = pick([*found, *homs], samples, low=low) or plan
        if out and (str(out[-1].strategy), out[-1].options) == (str(plan.strategy), plan.options):
            out[-1] = plan  # the same pipelines serve the longer maximum
            continue
        out.append(plan)
    return out


def _by_recompute(options: Sequence[StrategyOptions]) -> dict[StrategyOptions, list[StrategyOptions]]:  # fmt: skip
    """``options`` grouped by all but their recompute: each group plans as one pool whose
    pipelines recompute as each needs (the strategy marks it per stage, ``:RC<k>``)."""
    out: dict[StrategyOptions, list[StrategyOptions]] = {}
    for o in options:
        out.setdefault(replace(o, recompute=False, recompute_layers=0), []).append(o)
    return out


def _undominated(models: Sequence[PipeModel]) -> list[PipeModel]:
    """Per configuration, the models that recompute more only where that holds longer
    rows (fewer models: the DP's time)."""
    out: list[PipeModel] = []
    for m in sorted(models, key=lambda m: (str(m.config), m.redo)):
        same = [x for x in out if x.config == m.config]
        if all(m.fit_len > x.fit_len for x in same):
            out.append(m)
    return out


def option_sets(base: StrategyOptions, num_layers: int) -> list[StrategyOptions]:
    """``base`` without recompute, recomputing every layer, and recomputing the first
    ``k`` layers of each stage for ``k`` = 1, 2, 4, ... below ``num_layers``
    (``--recompute-layers``: less recompute where memory allows)."""
    out = [replace(base, recompute=False, recompute_layers=0),
           replace(base, recompute=True, recompute_layers=0)]  # fmt: skip
    out += [replace(base, recompute=True, recompute_layers=k) for k in _powers(num_layers - 1)]
    return out


def _powers(limit: int) -> tuple[int, ...]:
    out, z = [], 1
    while z <= limit:
        out.append(z)
        z *= 2
    return tuple(out)
