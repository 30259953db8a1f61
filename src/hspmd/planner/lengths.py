"""The length-aware planner: one heterogeneous strategy per maximum length, chosen per step.

Real corpora are long-tailed. From a histogram of document lengths (``Histogram``: bins at
powers of two up to the maximum length, with the count, tokens and squared lengths of
each) and the tokens per step ``N``:

1. **Micro-batch cost** (``PipeModel``): a pipeline of ``pp`` stages of ``tp`` ranks, layers
   split evenly, runs a packed micro-batch (one row of documents ``l_1..l_k``) on its
   slowest stage in ``o + a * sum(l) + q * sum(l^2)`` seconds forward and backward:
   ``hspmd.planner.workload.stage_work`` is exactly quadratic in the length (attention is
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
   documents runs a strategy without long-length pipelines.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hspmd.errors import HspmdError
from hspmd.models.config import LlamaConfig
from hspmd.plan.dispatch import Assignment, DispatchError
from hspmd.plan.strategy import Pipeline, Stage, Strategy, StrategyOptions
from hspmd.planner.closed_form import PLAN_HEADROOM, split_evenly
from hspmd.planner.cost import CostModel
from hspmd.planner.memory import rank_memory
from hspmd.planner.workload import stage_params, stage_work

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
    "pipe_configs",
    "plan_lengths",
    "plan_strategies",
    "switch_seconds",
    "load_plans",
    "plans_json",
    "switch_matrix",
]


class LengthPlanError(HspmdError, ValueError):
    """Length statistics, a cluster or a step the length planner cannot plan for."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """Bin ``k`` holds the lengths in ``(edges[k-1], edges[k]]`` (the first from 1);
    per bin the documents, their tokens and their squared lengths."""

    edges: tuple[int, ...]
    counts: tuple[int, ...]
    tokens: tuple[int, ...]
    squares: tuple[float, ...]

    @staticmethod
    def of(lengths: Sequence[int], *, max_len: int, smallest: int = 512) -> Histogram:
        """Bins at ``smallest * 2^k`` up to ``max_len`` (the last edge); a length over
        ``max_len`` counts as ``max_len`` (truncated)."""
        if max_len < 1 or smallest < 1:
            raise LengthPlanError(f"max_len={max_len}, smallest={smallest}: give positive lengths")
        lengths = [min(int(n), max_len) for n in lengths if n > 0]
        if not lengths:
            raise LengthPlanError("no documents: the length histogram needs at least one")
        edges = []
        edge = min(smallest, max_len)
        while edge < max_len:
            edges.append(edge)
            edge *= 2
        edges.append(max_len)
        counts, tokens, squares = [0] * len(edges), [0] * len(edges), [0.0] * len(edges)
        for n in lengths:
            k = next(i for i, e in enumerate(edges) if n <= e)
            counts[k] += 1
            tokens[k] += n
            squares[k] += float(n) * n
        return Histogram(tuple(edges), tuple(counts), tuple(tokens), tuple(squares))

    @property
    def max_len(self) -> int:
        return self.edges[-1]

    def upto(self, k: int) -> Histogram:
        """Bins ``0..k`` only: the documents of steps whose longest is at most ``edges[k]``."""
        return Histogram(self.edges[: k + 1], self.counts[: k + 1], self.tokens[: k + 1],
                         self.squares[: k + 1])  # fmt: skip

    def per_step(self, k: int, step_tokens: int) -> tuple[float, float, float]:
        """Bin ``k``'s expected (documents, tokens, squares) in a step of ``step_tokens``."""
        scale = step_tokens / max(sum(self.tokens), 1)
        return self.counts[k] * scale, self.tokens[k] * scale, self.squares[k] * scale

    def to_json(self) -> dict[str, Any]:
        return {"edges": list(self.edges), "counts": list(self.counts),
                "tokens": list(self.tokens)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class PipeConfig:
    """``pp`` stages of ``tp`` ranks."""

    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp}xPP{self.pp}"


@dataclass(frozen=True, slots=True)
class PipeModel:
    """A configuration's row time ``o + a * tokens + q * squares`` on its slowest stage
    (forward and backward), ``send_a * tokens + send_o`` per stage boundary, and the
    longest row that fits its memory (``fit_len``, 0 when none)."""

    config: PipeConfig
    o: float
    a: float
    q: float
    send_o: float
    send_a: float
    fit_len: int

    def row_seconds(self, tokens: float, squares: float) -> float:
        return self.o + self.a * tokens + self.q * squares if tokens > 0 else 0.0

    def seconds(self, rows: Sequence[tuple[float, float]]) -> float:
        """One step of ``rows`` = ``(tokens, squares)`` under 1F1B."""
        times = [self.row_seconds(n, s) for n, s in rows if n > 0]
        if not times:
            return 0.0
        longest = max(n for n, _ in rows)
        send = self.send_o + self.send_a * longest if self.config.pp > 1 else 0.0
        return sum(times) + (self.config.pp - 1) * (max(times) + 2 * send)


def _quadratic(f: Callable[[int], float]) -> tuple[float, float, float]:
    """``o, a, q`` of ``f(L) = o + a L + q L^2`` from ``L = 1024, 2048, 4096``."""
    y1, y2, y4 = f(1024), f(2048), f(4096)
    # y2 - y1 = 1024 a + 3 * 1024^2 q ; y4 - y2 = 2048 a + 12 * 1024^2 q
    d1, d2 = y2 - y1, y4 - y2
    q = (d2 - 2 * d1) / (6 * 1024**2)
    a = (d1 - 3 * 1024**2 * q) / 1024
    return y1 - a * 1024 - q * 1024**2, a, q


def pipe_model(
    config: LlamaConfig, cost: CostModel, pipe: PipeConfig, *, options: StrategyOptions,
    max_len: int, replicas: int = 1,
) -> PipeModel:  # fmt: skip
    """The ``PipeModel`` of ``pipe`` on ranks ``0..gpus-1`` of ``cost``'s cluster; with
    ZeRO-1 its optimizer states are sharded over ``replicas`` pipelines."""
    tp, pp = pipe.tp, pipe.pp
    ranks = tuple(range(tp))
    layers = -(-config.num_layers // pp)
    sp = options.sequence_parallel and tp > 1

    def work(length: int) -> float:
        w = stage_work(cost, config, ranks, layers, micro_batch_size=1, seq_len=length,
                       first=pp == 1, last=True, recompute=options.recompute,
                       sequence_parallel=sp)  # fmt: skip
        return w.forward_s + w.backward_s

    o, a, q = _quadratic(work)
    if pp > 1:
        peer = min(tp, cost.num_ranks - 1)
        elt = cost.element_bytes
        s1 = cost.send(config.hidden_size * elt * 1024 / tp, 0, peer)
        s2 = cost.send(config.hidden_size * elt * 2048 / tp, 0, peer)
        send_a, send_o = (s2 - s1) / 1024, 2 * s1 - s2
    else:
        send_a = send_o = 0.0
    cap = cost.device_of(0).memory_bytes * (1 - PLAN_HEADROOM)
    fit = 0
    length = 256
    while length <= max_len:
        if _memory(config, pipe, length, options, replicas) <= cap:
            fit = length
        length *= 2
    if max_len & (max_len - 1) and _memory(config, pipe, max_len, options, replicas) <= cap:
        fit = max_len
    return PipeModel(pipe, o, a, q, send_o, send_a, fit)


def _memory(
    config: LlamaConfig, pipe: PipeConfig, length: int, options: StrategyOptions, replicas: int
) -> float:
    """The larger peak of a pipeline's first and last stage with rows of ``length``."""
    layers = -(-config.num_layers // pipe.pp)
    peaks = []
    for first, last in ((True, pipe.pp == 1), (pipe.pp == 1, True)):
        mem = rank_memory(config, rank=0, tp=pipe.tp, num_layers=layers, first=first, last=last,
                          in_flight_micro_batches=pipe.pp if first else 1, micro_batch_size=1,
                          seq_len=length, replicas=replicas, options=options)  # fmt: skip
        peaks.append(mem.peak)
    return max(peaks)


def pipe_configs(
    config: LlamaConfig,
    cost: CostModel,
    *,
    options: StrategyOptions,
    max_len: int,
    replicas: int = 1,
) -> list[PipeModel]:
    """Every ``TP x PP`` that fits some row length (ZeRO-1 over ``replicas``): TP a power
    of two within a node and dividing the heads, PP at most the layers, ``tp * pp`` a power
    of two within the cluster."""
    kinds = {cost.kind_of(r) for r in range(cost.num_ranks)}
    if len(kinds) > 1:
        raise LengthPlanError(
            f"the length planner takes one GPU kind; this cluster has {', '.join(sorted(kinds))}"
            ": plan mixed kinds with `hspmd plan --global-batch`"
        )
    node = max(g.gpus_per_node for g in cost.cluster.groups)
    out = []
    tp = 1
    while tp <= node and config.num_heads % tp == 0:
        pp = 1
        while pp <= config.num_layers and tp * pp <= cost.num_ranks:
            model = pipe_model(config, cost, PipeConfig(tp, pp), options=options,
                               max_len=max_len, replicas=replicas)  # fmt: skip
            if model.fit_len:
                out.append(model)
            pp *= 2
        tp *= 2
    return out


@dataclass(frozen=True, slots=True)
class PipeSpec:
    """One pipeline of a length strategy: its configuration, its row length (the longest
    document it takes) and its micro-batch count when trained with fixed slots."""

    model: PipeModel
    row_len: int
    micro_batches: int = 1

    def to_json(self) -> dict[str, Any]:
        c = self.model.config
        m = self.model
        return {"tp": c.tp, "pp": c.pp, "max_len": self.row_len,
                "micro_batches": self.micro_batches,
                "cost": {"o": m.o, "a": m.a, "q": m.q, "send_o": m.send_o, "send_a": m.send_a}}  # fmt: skip


@dataclass(frozen=True)
class LengthStrategy:
    """Pipelines (``PipeSpec``) serving steps whose longest document is at most
    ``max_len``; ``intervals[p]``: the length range the DP gave pipeline ``p``;
    ``predicted_s``: the DP's step time on the expected step."""

    max_len: int
    pipes: tuple[PipeSpec, ...]
    intervals: tuple[tuple[int, int], ...]
    predicted_s: float
    sync_s: float = 0.0
    strategy: Strategy = field(default_factory=lambda: Strategy(()))
    options: StrategyOptions = field(default_factory=StrategyOptions)

    @property
    def gpus(self) -> int:
        return sum(p.model.config.gpus for p in self.pipes)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_len": self.max_len, "strategy": str(self.strategy),
            "recompute": self.options.recompute,
            "predicted_step_s": self.predicted_s, "sync_s": self.sync_s,
            "pipelines": [
                {**p.to_json(), "lengths": list(self.intervals[i])} for i, p in enumerate(self.pipes)
            ],
        }  # fmt: skip


def _interval_seconds(
    model: PipeModel, n: int, row_len: int, docs: float, tokens: float, squares: float
) -> float:
    """One of ``n`` pipelines' time on its share of an interval's expected documents."""
    x, s2, d = tokens / n, squares / n, docs / n
    if x <= 0:
        return 0.0
    rows = max(1, min(math.ceil(x / row_len), math.ceil(d)))
    return model.seconds([(x / rows, s2 / rows)] * rows)


def plan_lengths(
    hist: Histogram, models: Sequence[PipeModel], *, gpus: int, step_tokens: int,
    config: LlamaConfig | None = None, cost: CostModel | None = None,
    options: StrategyOptions | None = None,
) -> LengthStrategy:  # fmt: skip
    """The DP of the module docstring on ``hist`` over ``gpus`` GPUs: one heterogeneous
    strategy for steps of ``step_tokens`` tokens whose documents are at most
    ``hist.max_len``. With ``config`` and ``cost`` the result carries its hspmd
    ``Strategy`` (ranks numbered pipeline by pipeline, largest first) and its sync time."""
    K, edges = len(hist.edges), hist.edges
    per = [hist.per_step(k, step_tokens) for k in range(K)]
    inf = math.inf
    # f[j][g]: bins 0..j-1 on g GPUs; back[j][g]: (i, model index, n, row_len, seconds)
    f = [[inf] * (gpus + 1) for _ in range(K + 1)]
    back: list[list[tuple[int, int, int, int, float] | None]] = [
        [None] * (gpus + 1) for _ in range(K + 1)
    ]
    f[0][0] = 0.0
    for j in range(1, K + 1):
        for i in range(1, j + 1):
            docs = sum(per[k][0] for k in range(i - 1, j))
            tokens = sum(per[k][1] for k in range(i - 1, j))
            squares = sum(per[k][2] for k in range(i - 1, j))
            if tokens <= 0 and i < j:
                continue
            for mi, model in enumerate(models):
                for row_len in edges[j - 1 :]:
                    if row_len > model.fit_len:
                        break
                    size = model.config.gpus
                    for n in range(1, gpus // size + 1):
                        t = _interval_seconds(model, n, row_len, docs, tokens, squares)
                        for g0 in range(gpus - n * size + 1):
                            prev = f[i - 1][g0]
                            if prev == inf:
                                continue
                            value = max(prev, t)
                            g = g0 + n * size
                            if value < f[j][g] - 1e-12:
                                f[j][g] = value
                                back[j][g] = (i, mi, n, row_len, t)
    best_g = min(range(gpus + 1), key=lambda g: (f[K][g], g))
    if f[K][best_g] == inf:
        raise LengthPlanError(
            f"no pipeline of {gpus} GPUs fits a row of {hist.max_len} tokens in memory: "
            "lower --max-seq-len or use a larger cluster"
        )
    pipes: list[PipeSpec] = []
    intervals: list[tuple[int, int]] = []
    j, g = K, best_g
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
    order = sorted(
        range(len(pipes)), key=lambda p: (-pipes[p].model.config.gpus, -pipes[p].row_len)
    )
    pipes = [pipes[p] for p in order]
    intervals = [intervals[p] for p in order]
    out = LengthStrategy(hist.max_len, tuple(pipes), tuple(intervals), f[K][best_g])
    if config is not None and cost is not None:
        strategy = to_strategy(out.pipes, config.num_layers)
        sync = sync_seconds(strategy, config, cost, zero1=bool(options and options.zero1))
        out = LengthStrategy(out.max_len, out.pipes, out.intervals, out.predicted_s + sync,
                             sync, strategy, options or StrategyOptions())  # fmt: skip
    return out


def to_strategy(pipes: Sequence[PipeSpec], num_layers: int) -> Strategy:
    """The hspmd strategy of ``pipes`` on consecutive ranks, layers split evenly."""
    pipelines, at = [], 0
    for spec in pipes:
        tp, pp = spec.model.config.tp, spec.model.config.pp
        stages, first = [], 0
        for count in split_evenly(num_layers, pp):
            stages.append(Stage(tuple(range(at, at + tp)), first, first + count - 1))
            at, first = at + tp, first + count
        pipelines.append(Pipeline(spec.micro_batches, 1, tuple(stages)))
    return Strategy(tuple(pipelines))


def sync_seconds(
    strategy: Strategy, config: LlamaConfig, cost: CostModel, *, zero1: bool = False
) -> float:
    """The gradient all-reduce across pipelines (fp32, the largest per-rank shard, over the
    pipelines' first ranks) and Adam on the largest per-rank shard, once per step; with
    ZeRO-1 a reduce-scatter, Adam on a 1/d shard and an all-gather of the weights."""
    shards = [
        stage_params(config, len(st.layers), st.tp, first=s == 0,
                     last=s == len(strategy.pipelines[p].stages) - 1)
        for p, s, st in strategy.stages()
    ]  # fmt: skip
    biggest = max(shards)
    ring = tuple(pipe.stages[0].ranks[0] for pipe in strategy.pipelines)
    allreduce = cost.collective("all-reduce", 4 * biggest, ring) if len(ring) > 1 else 0.0
    if zero1 and len(ring) > 1:  # reduce-scatter, Adam on the shard, all-gather bf16 weights
        gather = cost.collective("all-gather", cost.element_bytes * biggest, ring)
        shard = 4 * biggest / len(ring)
        return allreduce / 2 + gather + cost.device_of(0).seconds("optimizer", shard)
    return allreduce + cost.device_of(0).seconds("optimizer", 4 * biggest)


def plan_strategies(
    config: LlamaConfig, cost: CostModel, hist: Histogram, *, step_tokens: int,
    options: Sequence[StrategyOptions], count: int = 4,
) -> list[LengthStrategy]:  # fmt: skip
    """One DP strategy per maximum length: ``hist``'s last ``count`` edges (each the DP on
    the histogram cut there, under each of ``options``, the fastest kept), shortest maximum
    first; duplicates dropped. Under ZeRO-1 the DP runs once per replica count ``z`` (1, 2,
    4, ...: memory with states sharded ``z`` ways) and keeps results of at least ``z``
    pipelines."""
    pools = [
        (o, z, pipe_configs(config, cost, options=o, max_len=hist.max_len, replicas=z))
        for o in options
        for z in (_powers(cost.num_ranks) if o.zero1 else (1,))
    ]
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
        if out and (str(out[-1].strategy), out[-1].options) == (str(plan.strategy), plan.options):
            out[-1] = plan  # the same pipelines serve the longer maximum
            continue
        out.append(plan)
    return out


def _powers(limit: int) -> tuple[int, ...]:
    out, z = [], 1
    while z <= limit:
        out.append(z)
        z *= 2
    return tuple(out)


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


def switch_seconds(a: Strategy, b: Strategy, config: LlamaConfig, cost: CostModel) -> float:
    """The fused BSR of the bf16 compute weights ``a -> b`` (``--switch-mode weights``)."""
    from hspmd.plan.params import state_annotations
    from hspmd.switch.cost import STATES, estimate_scheme, switch_tables

    tables = switch_tables(state_annotations(a, config), state_annotations(b, config),
                           itemsize=STATES["bf16"], failed=set())  # fmt: skip
    return float(estimate_scheme(tables, "fused", topology=cost.cluster.topology()).time)


def ideal_seconds(lengths: Sequence[int], config: LlamaConfig, cost: CostModel) -> float:
    """Every GPU computing the step's FLOPs (document-masked attention), no communication,
    no bubbles, no launch overheads: the bound."""

    def work(length: int) -> float:
        w = stage_work(cost, config, (0,), config.num_layers, micro_batch_size=1,
                       seq_len=length, first=True, last=True)  # fmt: skip
        return w.forward_s + w.backward_s

    _, a, q = _quadratic(work)
    return sum(a * n + q * float(n) * n for n in lengths) / cost.num_ranks


def fixed_dispatcher(plan: LengthStrategy) -> Callable[..., Assignment]:
    """A ``plan.dispatch`` dispatcher into ``plan.strategy``'s fixed micro-batches (one row
    each): documents longest first, each to the pipeline whose row length holds it and
    whose predicted time after taking it is least, into its least loaded micro-batch that
    holds it; the last documents fill micro-batches still empty."""

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
            n = lengths[i]
            empty = [sum(r[0] == 0 for r in pipe) for pipe in load]
            must_fill = len(order) - k <= sum(empty)
            best: tuple[float, int, int] | None = None
            for p, pipe in enumerate(load):
                if caps[p] < n or (must_fill and not empty[p]):
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
                    f"document {i} ({n} tokens) fits no micro-batch of the plan for "
                    f"{plan.max_len}: lower the tokens per step"
                )
            _, p, m = best
            load[p][m][0] += n
            load[p][m][1] += float(n) * n
            out[i] = (p, m, 0)
        left = [(p, m) for p, pipe in enumerate(load) for m, r in enumerate(pipe) if r[0] == 0]
        if left:
            raise DispatchError(
                f"{len(lengths)} documents leave micro-batch {left[0][1]} of pipeline "
                f"{left[0][0]} empty: a step needs at least one document per micro-batch"
            )
        packed = tuple(
            tuple(math.ceil(int(r[0]) / multiple) * multiple for r in pipe) for pipe in load
        )
        return Assignment(
            tuple(out), packed, tuple(1 for _ in slots), tuple(int(n) for n in lengths)
        )

    return run


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


def plans_json(
    plans: Sequence[LengthStrategy], hist: Histogram, *, model: str, cluster: str,
    step_tokens: int, switch: Sequence[Sequence[float]],
) -> dict[str, Any]:  # fmt: skip
    """The ``hspmd plan --data`` file (docs/mixed-length.md, "The plans file");
    ``switch[i][j]``: the predicted seconds of the switch from strategy ``i`` to ``j``."""
    return {
        "format": "hspmd.length-plans", "version": 1, "model": model, "cluster": cluster,
        "tokens_per_step": step_tokens, "max_len": hist.max_len,
        "histogram": hist.to_json(), "strategies": [p.to_json() for p in plans],
        "switch_s": [[float(x) for x in row] for row in switch],
    }  # fmt: skip


def switch_matrix(
    plans: Sequence[LengthStrategy], config: LlamaConfig, cost: CostModel
) -> list[list[float]]:
    """``switch_seconds`` between every pair of ``plans`` (0 on the diagonal)."""
    return [
        [0.0 if i == j else switch_seconds(a.strategy, b.strategy, config, cost)
         for j, b in enumerate(plans)]
        for i, a in enumerate(plans)
    ]  # fmt: skip


def load_plans(data: Any, where: str) -> tuple[list[LengthStrategy], list[list[float]]]:
    """The strategies of a plans file (``plans_json``) and its switch matrix."""
    from hspmd.plan.strategy import StrategyError, parse_strategy

    if not isinstance(data, dict) or data.get("format") != "hspmd.length-plans":
        raise LengthPlanError(
            f"{where}: not a plans file (format hspmd.length-plans): write one with "
            "`hspmd plan --data PATH --max-seq-len L --tokens-per-step N --out FILE`"
        )
    if data.get("version") != 1:
        raise LengthPlanError(
            f"{where}: plans file version {data.get('version')!r}, this hspmd reads version 1: "
            "write it again with this hspmd's `hspmd plan --data`"
        )
    out = []
    try:
        for entry in data["strategies"]:
            strategy = parse_strategy(entry["strategy"])
            pipes, intervals = [], []
            for pipe in entry["pipelines"]:
                c = pipe["cost"]
                model = PipeModel(PipeConfig(int(pipe["tp"]), int(pipe["pp"])), float(c["o"]),
                                  float(c["a"]), float(c["q"]), float(c["send_o"]),
                                  float(c["send_a"]), int(pipe["max_len"]))  # fmt: skip
                pipes.append(PipeSpec(model, int(pipe["max_len"]), int(pipe["micro_batches"])))
                lo, hi = pipe["lengths"]
                intervals.append((int(lo), int(hi)))
            options = StrategyOptions(recompute=bool(entry.get("recompute", False)))
            out.append(LengthStrategy(int(entry["max_len"]), tuple(pipes), tuple(intervals),
                                      float(entry["predicted_step_s"]), float(entry["sync_s"]),
                                      strategy, options))  # fmt: skip
            if len(strategy.pipelines) != len(pipes):
                raise ValueError(f"strategy {entry['strategy']!r} has not {len(pipes)} pipelines")
        switch = [[float(x) for x in row] for row in data["switch_s"]]
    except (KeyError, TypeError, ValueError, StrategyError) as error:
        raise LengthPlanError(f"{where}: bad plans file ({error})") from None
    if not out:
        raise LengthPlanError(f"{where}: no strategies")
    if len(switch) != len(out) or any(len(row) != len(out) for row in switch):
        raise LengthPlanError(f"{where}: switch_s is not {len(out)} x {len(out)}")
    return out, switch
