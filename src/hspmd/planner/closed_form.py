"""Closed-form costs the planner ranks configurations by, before the ILPs and the simulator.

A configuration's stages are *units* (TP groups of one GPU kind inside one node). Per unit
and micro-batch size, ``StageCosts`` gives lines ``slope * layers + constant``: seconds of
forward plus backward (``hspmd.cost.stage``), bytes of memory
(``hspmd.planner.memory``), sends between neighbours, and the gradient sync and Adam of
the slowest stage. ``water_fill`` spreads the layers so every stage below its memory cap
ends at the same time; the 1F1B formula ``(m - 1) * slowest + sum`` then gives the time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from hspmd.cost.lines import CostModel
from hspmd.cost.stage import StageWork, layer_params, stage_work
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import StrategyOptions
from hspmd.planner.memory import in_flight, rank_memory
from hspmd.planner.predict import Prediction

__all__ = [
    "MICRO_BATCH_SIZES",
    "PLAN_HEADROOM",
    "StageCosts",
    "Unit",
    "fastest_fitting",
    "node_ranks",
    "split_evenly",
    "tp_degrees",
    "units_of",
    "water_fill",
    "within_headroom",
]

MICRO_BATCH_SIZES = (1, 2, 4, 8)
# Plans leave this fraction of every device's memory free: the memory model is an estimate
# (allocator fragmentation, workspace of kernels it does not list).
PLAN_HEADROOM = 0.05


# -- units and configurations ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unit:
    """A TP group of ``ranks`` of one GPU kind inside one node: one stage of a pipeline."""

    kind: str
    ranks: tuple[int, ...]
    node: int


def node_ranks(cost: CostModel) -> list[tuple[str, tuple[int, ...]]]:
    out, first = [], 0
    for group in cost.cluster.groups:
        for _ in range(group.count):
            out.append((group.kind, tuple(range(first, first + group.gpus_per_node))))
            first += group.gpus_per_node
    return out


def tp_degrees(config: ModelSpec, node_sizes: Sequence[int]) -> list[int]:
    """TP degrees that divide every node size given and the model's split dimensions
    (``tp_sizes`` of all its layers: a Llama's heads, KV heads, FFN width and vocabulary);
    1 only for a model that splits nothing."""
    sizes = tuple(config.tp_sizes(0, config.num_layers - 1).values())
    if not sizes:
        return [1]
    top = min(node_sizes)
    return [
        t for t in range(1, top + 1)
        if all(n % t == 0 for n in node_sizes) and all(x % t == 0 for x in sizes)
    ]  # fmt: skip


def units_of(cost: CostModel, kind: str, tp: int) -> list[Unit]:
    units = []
    for node, (k, ranks) in enumerate(node_ranks(cost)):
        if k == kind:
            units += [Unit(kind, ranks[i : i + tp], node) for i in range(0, len(ranks), tp)]
    return units


# -- closed-form costs ----------------------------------------------------------------------


class StageCosts:
    """Cached per-stage cost lines: seconds and bytes as ``slope * layers + constant``."""

    def __init__(self, cost: CostModel, config: ModelSpec, seq_len: int) -> None:
        self.cost, self.config, self.seq_len = cost, config, seq_len
        self.memory = lru_cache(maxsize=None)(self._memory)
        self._lines: dict[tuple[Any, ...], tuple[float, float]] = {}
        self._sends: dict[tuple[Any, ...], float] = {}
        self._works: dict[tuple[Any, ...], StageWork] = {}
        self._kinds: dict[tuple[int, ...], tuple[Any, ...]] = {}
        self._syncs: dict[tuple[Any, ...], float] = {}

    def work(
        self, ranks: tuple[int, ...], layers: int, mbs: int, first: bool, last: bool,
        recompute: bool, sp: bool,
    ) -> StageWork:  # fmt: skip
        """``stage_work`` of the stage of ``ranks``, cached by what of the ranks it reads
        (``kinds``). The 4096 stages of a homogeneous layout are then one computation, not
        4096."""
        key = (self.kinds(ranks), layers, mbs, first, last, recompute, sp)
        out = self._works.get(key)
        if out is None:
            out = self._works[key] = stage_work(
                self.cost, self.config, ranks, layers, micro_batch_size=mbs,
                seq_len=self.seq_len, first=first, last=last, recompute=recompute,
                sequence_parallel=sp,
            )  # fmt: skip
        return out

    def kinds(self, ranks: tuple[int, ...]) -> tuple[Any, ...]:
        """What a stage's costs read of its ``ranks``: their kinds in order (the slowest
        sets the pace) and their TP link (across nodes or not); stages alike in it cost
        alike (cached per rank tuple)."""
        kinds = self._kinds.get(ranks)
        if kinds is None:
            cost = self.cost
            spans = len({cost.node_of(r) for r in ranks}) > 1
            same = len(ranks) > 1 and ranks[0] == ranks[1]
            kinds = self._kinds[ranks] = (tuple(cost.kind_of(r) for r in ranks), spans, same)
        return kinds

    def line(
        self, unit: Unit, mbs: int, first: bool, last: bool, options: StrategyOptions,
    ) -> tuple[float, float]:  # fmt: skip
        """(seconds per layer, constant seconds) of forward plus backward per micro-batch.

        A unit's costs depend on its kind and TP degree only (its TP group sits in a node)."""
        rc, sp = options.recompute, options.sequence_parallel
        key = (unit.kind, len(unit.ranks), mbs, first, last, rc, sp)
        if key not in self._lines:
            w0 = self.work(unit.ranks, 0, mbs, first, last, rc, sp)
            w1 = self.work(unit.ranks, 1, mbs, first, last, rc, sp)
            t0, t1 = w0.forward_s + w0.backward_s, w1.forward_s + w1.backward_s
            self._lines[key] = (t1 - t0, t0)
        return self._lines[key]

    def _memory(
        self, kind: str, tp: int, flight: int, mbs: int, first: bool, last: bool,
        replicas: int, options: StrategyOptions,
    ) -> tuple[float, float]:  # fmt: skip
        def peak(layers: int) -> float:
            return rank_memory(
                self.config, rank=0, tp=tp, num_layers=layers, first=first, last=last,
                in_flight_micro_batches=flight, micro_batch_size=mbs, seq_len=self.seq_len,
                replicas=replicas, options=options,
            ).peak  # fmt: skip

        alpha = peak(2) - peak(1)
        return alpha, peak(1) - alpha

    def send(self, a: Unit, b: Unit, mbs: int) -> float:
        key = (a.kind, min(len(a.ranks), len(b.ranks)), a.node == b.node, mbs)
        if key not in self._sends:
            nbytes = mbs * self.seq_len * self.config.hidden_size * self.cost.element_bytes
            self._sends[key] = self.cost.send(nbytes / key[1], a.ranks[0], b.ranks[0])
        return self._sends[key]

    def stage_lines(
        self, units: Sequence[Unit], mbs: int, m: int, replicas: int, options: StrategyOptions,
    ) -> tuple[list[float], list[float], list[float], list[float], list[float]]:  # fmt: skip
        """Per stage: time slope, time constant (with sends), memory slope, constant, cap."""
        count = len(units)
        a, c, alpha, beta, cap = [], [], [], [], []
        for s, unit in enumerate(units):
            first, last = s == 0, s == count - 1
            slope, const = self.line(unit, mbs, first, last, options)
            if s + 1 < count:
                const += 2 * self.send(unit, units[s + 1], mbs)
            flight = in_flight(options.schedule, count, s, m)
            ma, mb = self.memory(
                unit.kind, len(unit.ranks), flight, mbs, first, last, replicas, options
            )
            a.append(slope)
            c.append(const)
            alpha.append(ma)
            beta.append(mb)
            cap.append(self.cost.device(unit.kind).memory_bytes * (1 - PLAN_HEADROOM))
        return a, c, alpha, beta, cap

    def sync(
        self, units: Sequence[Unit], layers: Sequence[float], d: int, options: StrategyOptions,
    ) -> float:  # fmt: skip
        """Gradient sync (over the inter-node link) and Adam of the slowest stage (cached:
        it reads the units' kinds and TP degrees only)."""
        key = (tuple((u.kind, len(u.ranks)) for u in units), tuple(layers), d, options.zero1)
        out = self._syncs.get(key)
        if out is None:
            out = self._syncs[key] = self._sync(units, layers, d, options)
        return out

    def _sync(
        self, units: Sequence[Unit], layers: Sequence[float], d: int, options: StrategyOptions,
    ) -> float:  # fmt: skip
        per_layer = layer_params(self.config)
        link = self.cost.links[self.cost.cluster.inter_link.name]
        z = d if options.zero1 else 1
        worst = 0.0
        for unit, count in zip(units, layers, strict=True):
            shard = count * per_layer / len(unit.ranks)
            if d <= 1:
                sync = 0.0
            elif options.zero1:
                sync = link.seconds("reduce-scatter", 4 * shard, d)
                sync += link.seconds("all-gather", self.cost.element_bytes * shard, d)
            else:
                sync = link.seconds("all-reduce", 4 * shard, d)
            adam = self.cost.device(unit.kind).seconds("optimizer", 4 * shard / z)
            worst = max(worst, sync + adam)
        return worst


def water_fill(
    L: int, m: int, a: Sequence[float], c: Sequence[float], cap_layers: Sequence[float]
) -> tuple[float, list[float]] | None:
    """Continuous layers ``l_s`` in ``[1, cap_s]`` summing to ``L`` that minimize the slowest
    stage ``a_s * l_s + c_s``: every stage below its cap ends at the same time ``T``.

    ``sum_s clamp((T - c_s) / a_s, 1, cap_s)`` is piecewise linear in ``T``; walk its
    breakpoints in order and interpolate on the segment that reaches ``L``.
    """
    if sum(cap_layers) < L or any(x < 1 for x in cap_layers):
        return None
    count = len(a)

    def layers_at(T: float) -> list[float]:
        return [
            min(cap_layers[s], max(1.0, (T - c[s]) / a[s])) if a[s] > 0 else cap_layers[s]
            for s in range(count)
        ]

    points = sorted({c[s] + a[s] * x for s in range(count) for x in (1.0, cap_layers[s])})
    lo = points[0]
    T = points[-1]
    below = sum(layers_at(lo))
    for point in points[1:]:
        total = sum(layers_at(point))
        if total >= L:
            T = lo + (point - lo) * (L - below) / (total - below) if total > below else point
            break
        lo, below = point, total
    layers = layers_at(T)
    stage = [a[s] * layers[s] + c[s] for s in range(count)]
    return (m - 1) * max(stage) + sum(stage), layers


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (p < extra) for p in range(parts)]


def within_headroom(p: Prediction, cost: CostModel) -> bool:
    limit = 1 - PLAN_HEADROOM
    return all(m.peak <= cost.device_of(r).memory_bytes * limit for r, m in p.memory.items())


def fastest_fitting(predictions: Sequence[Prediction], cost: CostModel) -> Prediction | None:
    fits = [p for p in predictions if within_headroom(p, cost)]
    return min(fits, key=lambda p: p.step_time_s) if fits else None
