"""The length planner's model: the length histogram, the row cost of a pipeline
configuration, the longest row it fits, and the strategies the DP returns (as data).

A pipeline of ``pp`` stages of ``tp x cp`` ranks (TP, and context parallelism inside each
stage), layers split evenly, runs a packed row of documents ``l_1..l_k`` on its slowest
stage in ``o + a * sum(l) + q * sum(l^2)`` seconds forward and backward
(``hspmd.cost.stage.stage_work`` is exactly quadratic in the length: attention is
``s^2``, so three evaluations give ``o, a, q``). ``hspmd.planner.lengths`` plans with it.

>>> h = Histogram.of([100] * 90 + [3000] * 10, max_len=4096, smallest=1024)
>>> h.edges, h.counts, h.tokens
((1024, 2048, 4096), (90, 0, 10), (9000, 0, 30000))
>>> str(PipeConfig(4, 2, cp=2)), PipeConfig(4, 2, cp=2).gpus
('TP4xCP2xPP2', 16)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hspmd.cost.lines import CostModel
from hspmd.cost.stage import stage_params, stage_work, trains_context_parallel
from hspmd.errors import HspmdError
from hspmd.models.spec import HEADS, ModelSpec
from hspmd.plan.strategy import Pipeline, Stage, Strategy, StrategyOptions
from hspmd.planner.closed_form import PLAN_HEADROOM, split_evenly
from hspmd.planner.memory import rank_memory

__all__ = [
    "Histogram",
    "LengthPlanError",
    "LengthStrategy",
    "PipeConfig",
    "PipeModel",
    "PipeSpec",
    "ideal_seconds",
    "pipe_configs",
    "pipe_model",
    "sync_seconds",
    "to_strategy",
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
    """``pp`` stages of ``tp x cp`` ranks (``cp``: the context-parallel degree, Ulysses
    style: the sequence split over ``cp`` consecutive ranks, attention on whole rows of
    ``heads / (tp cp)``)."""

    tp: int
    pp: int
    cp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp

    def __str__(self) -> str:
        cp = f"xCP{self.cp}" if self.cp > 1 else ""
        return f"TP{self.tp}{cp}xPP{self.pp}"


@dataclass(frozen=True, slots=True)
class PipeModel:
    """A configuration's row time ``o + a * tokens + q * squares`` on its slowest stage
    (forward and backward), ``send_a * tokens + send_o`` per stage boundary, the longest
    row that fits its memory (``fit_len``, 0 when none) and how many of each stage's first
    layers recompute (``redo``; a stage of fewer layers recomputes them all)."""

    config: PipeConfig
    o: float
    a: float
    q: float
    send_o: float
    send_a: float
    fit_len: int
    redo: int = 0

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
    config: ModelSpec, cost: CostModel, pipe: PipeConfig, *, options: StrategyOptions,
    max_len: int, replicas: int = 1,
) -> PipeModel:  # fmt: skip
    """The ``PipeModel`` of ``pipe`` on ranks ``0..gpus-1`` of ``cost``'s cluster; with
    ZeRO-1 its optimizer states are sharded over ``replicas`` pipelines. Sequence
    parallelism applies to stages without CP only (as the runtime runs them)."""
    tp, pp, cp = pipe.tp, pipe.pp, pipe.cp
    ranks = tuple(range(tp * cp))
    layers = -(-config.num_layers // pp)
    sp = options.sequence_parallel and tp > 1 and cp == 1

    def work(length: int) -> float:
        w = stage_work(cost, config, ranks, layers, micro_batch_size=1, seq_len=length,
                       first=pp == 1, last=True, recompute=options.recompute,
                       sequence_parallel=sp, cp=cp,
                       recompute_layers=options.recompute_layers)  # fmt: skip
        return w.forward_s + w.backward_s

    o, a, q = _quadratic(work)
    if pp > 1:
        peer = min(tp * cp, cost.num_ranks - 1)
        elt = cost.element_bytes
        s1 = cost.send(config.hidden_size * elt * 1024 / (tp * cp), 0, peer)
        s2 = cost.send(config.hidden_size * elt * 2048 / (tp * cp), 0, peer)
        send_a, send_o = (s2 - s1) / 1024, 2 * s1 - s2
    else:
        send_a = send_o = 0.0
    fit = _fit_len(config, cost, pipe, max_len=max_len, options=options, replicas=replicas)
    return PipeModel(pipe, o, a, q, send_o, send_a, fit, options.recomputed(layers))


def _fit_len(
    config: ModelSpec, cost: CostModel, pipe: PipeConfig, *, max_len: int,
    options: StrategyOptions, replicas: int,
) -> int:  # fmt: skip
    """The longest row that fits memory: ``max_len``, else the longest power of two below
    it (at least ``cp``), else 0."""
    cap = cost.device_of(0).memory_bytes * (1 - PLAN_HEADROOM)
    length = max_len
    while length >= pipe.cp:
        if length % pipe.cp == 0 and _memory(config, pipe, length, options, replicas) <= cap:
            return length
        length = 1 << ((length - 1).bit_length() - 1) if length > 1 else 0  # 2^k below
    return 0


def _memory(
    config: ModelSpec, pipe: PipeConfig, length: int, options: StrategyOptions, replicas: int
) -> float:
    """The larger peak of a pipeline's first and last stage with rows of ``length``."""
    layers = -(-config.num_layers // pipe.pp)
    peaks = []
    for first, last in ((True, pipe.pp == 1), (pipe.pp == 1, True)):
        mem = rank_memory(config, rank=0, tp=pipe.tp, num_layers=layers, first=first, last=last,
                          in_flight_micro_batches=pipe.pp if first else 1, micro_batch_size=1,
                          seq_len=length, replicas=replicas, options=options,
                          cp=pipe.cp)  # fmt: skip
        peaks.append(mem.peak)
    return max(peaks)


def pipe_configs(
    config: ModelSpec,
    cost: CostModel,
    *,
    options: StrategyOptions,
    max_len: int,
    replicas: int = 1,
    context_parallel: bool = True,
) -> list[PipeModel]:
    """Every ``TP x CP x PP`` that fits some row length (ZeRO-1 over ``replicas``): TP and
    CP powers of two, ``TP x CP`` within a node dividing the heads (and, with CP, the KV
    heads: the all-to-all splits both), PP at most the layers, the whole a power of two
    within the cluster; CP only where ``context_parallel``."""
    kinds = {cost.kind_of(r) for r in range(cost.num_ranks)}
    if len(kinds) > 1:
        raise LengthPlanError(
            f"the length planner takes one GPU kind; this cluster has {', '.join(sorted(kinds))}"
            ": plan mixed kinds with `hspmd plan --global-batch`"
        )
    node = max(g.gpus_per_node for g in cost.cluster.groups)
    out = []
    for tp, cp in _tp_cp(config, node, context_parallel=context_parallel):
        pp = 1
        while pp <= config.num_layers and tp * cp * pp <= cost.num_ranks:
            model = pipe_model(config, cost, PipeConfig(tp, pp, cp), options=options,
                               max_len=max_len, replicas=replicas)  # fmt: skip
            if model.fit_len:
                out.append(model)
            pp *= 2
    return out


def _tp_cp(config: ModelSpec, node: int, *, context_parallel: bool) -> list[tuple[int, int]]:
    """``(tp, cp)`` pairs of powers of two: ``tp`` dividing every size the model's TP must
    divide (``tp_sizes``), ``tp * cp`` within ``node`` and, for ``cp > 1``, the heads of
    every attention-head marker split as ``check_strategy`` splits them (``heads`` over
    TP x CP, ``cp_heads``, which TP leaves whole, over CP). A model without such markers
    takes no CP, nor one whose cost function does not price it (``context_parallel``)."""
    sizes = list(config.tp_sizes(0, config.num_layers - 1).values())
    priced = trains_context_parallel(config)
    heads = [(m.trailing[0], m.placement == "heads") for m in config.markers()
             if m.placement in HEADS and priced]  # fmt: skip
    out = []
    tp = 1
    while tp <= node and all(n % tp == 0 for n in sizes):
        cp = 1
        while tp * cp <= node:
            if cp == 1 or (
                heads and all(n % ((tp if by_tp else 1) * cp) == 0 for n, by_tp in heads)
            ):
                out.append((tp, cp))
            if not context_parallel:
                break
            cp *= 2
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
        return {"tp": c.tp, "cp": c.cp, "pp": c.pp, "max_len": self.row_len,
                "micro_batches": self.micro_batches, "recompute_layers": m.redo,
                "cost": {"o": m.o, "a": m.a, "q": m.q, "send_o": m.send_o, "send_a": m.send_a}}  # fmt: skip


@dataclass(frozen=True)
class LengthStrategy:
    """Pipelines (``PipeSpec``) serving steps whose longest document is at most
    ``max_len``; ``intervals[p]``: the length range the DP gave pipeline ``p``;
    ``predicted_s``: the DP's step time on the expected step, or, where sample steps chose
    the strategy (``length_candidates.pick``), its mean predicted time over them."""

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
            "recompute_layers": self.options.recompute_layers,
            "sequence_parallel": self.options.sequence_parallel,
            "predicted_step_s": self.predicted_s, "sync_s": self.sync_s,
            "pipelines": [
                {**p.to_json(), "lengths": list(self.intervals[i])} for i, p in enumerate(self.pipes)
            ],
        }  # fmt: skip


def ideal_seconds(lengths: Sequence[int], config: ModelSpec, cost: CostModel) -> float:
    """Every GPU computing the step's FLOPs (document-masked attention), no communication,
    no bubbles, no launch overheads: the bound."""

    def work(length: int) -> float:
        w = stage_work(cost, config, (0,), config.num_layers, micro_batch_size=1,
                       seq_len=length, first=True, last=True)  # fmt: skip
        return w.forward_s + w.backward_s

    _, a, q = _quadratic(work)
    return sum(a * n + q * float(n) * n for n in lengths) / cost.num_ranks


def to_strategy(pipes: Sequence[PipeSpec], num_layers: int) -> Strategy:
    """The hspmd strategy of ``pipes`` on consecutive ranks, layers split evenly, each
    stage of a pipeline that recomputes marked with its count (``:RC<k>``)."""
    pipelines, at = [], 0
    for spec in pipes:
        c, redo = spec.model.config, spec.model.redo
        width = c.tp * c.cp
        stages, first = [], 0
        for count in split_evenly(num_layers, c.pp):
            rc = min(redo, count) if redo else None
            ranks = tuple(range(at, at + width))
            stages.append(Stage(ranks, first, first + count - 1, cp=c.cp, recompute=rc))
            at, first = at + width, first + count
        pipelines.append(Pipeline(spec.micro_batches, 1, tuple(stages)))
    return Strategy(tuple(pipelines))


def sync_seconds(
    strategy: Strategy, config: ModelSpec, cost: CostModel, *, zero1: bool = False
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
    side = min(pipe.stages[0].tp for pipe in strategy.pipelines)  # rings side by side
    allreduce = cost.collective("all-reduce", 4 * biggest, ring, side) if len(ring) > 1 else 0.0
    if zero1 and len(ring) > 1:  # reduce-scatter, Adam on the shard, all-gather bf16 weights
        gather = cost.collective("all-gather", cost.element_bytes * biggest, ring, side)
        shard = 4 * biggest / len(ring)
        return allreduce / 2 + gather + cost.device_of(0).seconds("optimizer", shard)
    return allreduce + cost.device_of(0).seconds("optimizer", 4 * biggest)
