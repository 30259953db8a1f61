"""The planner: search pipeline configurations, solve the ILPs, keep the fastest that fits.

Level 1, pipeline configurations (enumerated, then pruned). A *unit* is a TP group of
``t_k`` ranks of one GPU kind inside one node; per kind ``k`` the search tries every TP
degree ``t_k`` that divides the node size, the heads, the kv heads, the FFN and the
vocabulary. With ``U_k`` units of kind ``k`` and ``d`` pipelines, each pipeline gets
``U_k // d`` units of kind ``k`` (one stage each; the ``U_k mod d`` left over either stay
idle or join the first pipelines), stages of one kind contiguous, kinds in each order.
Every configuration is costed in closed form (water-filling the layers over its stages
under their memory caps, the 1F1B formula, the gradient sync), and only the best few per
micro-batch size go on.

Level 2, for the survivors: the ILPs of ``hspmd.planner.ilp`` (layers per stage, then
micro-batches per pipeline, then layers again for each pipeline's count), then the
discrete-event simulation of the resulting strategy (``hspmd.planner.predict``); the
fastest simulated plan that fits memory wins.

The homogeneous baseline is Megatron's: DP x TP x PP over every rank, even layers, one
micro-batch size, ranks in Megatron's order (TP, then DP, then PP) or pipeline-major,
simulated by the same simulator.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from hspmd.errors import HspmdError
from hspmd.models.config import LlamaConfig
from hspmd.plan.strategy import Pipeline, Stage, Strategy, StrategyOptions
from hspmd.planner.cost import CostModel
from hspmd.planner.ilp import layers_per_stage, micro_batches_per_pipeline
from hspmd.planner.memory import in_flight, rank_memory
from hspmd.planner.predict import Prediction, predict
from hspmd.planner.workload import StageWork, layer_params, stage_work

__all__ = ["Plan", "PlanError", "homogeneous_plan", "megatron_strategy", "plan"]

Zero1 = Literal["auto", "on", "off"]
MICRO_BATCH_SIZES = (1, 2, 4, 8)
# Plans leave this fraction of every device's memory free: the memory model is an estimate
# (allocator fragmentation, workspace of kernels it does not list).
PLAN_HEADROOM = 0.05
KEEP = 4  # configurations per micro-batch size that reach the ILPs and the simulator
KEEP_ALL = 6  # ... and in all


class PlanError(HspmdError, ValueError):
    """No plan fits, or the request cannot be planned (bad batch, bad options)."""


@dataclass(frozen=True)
class Plan:
    """The chosen strategy, its options, the simulated step and the homogeneous baseline."""

    prediction: Prediction
    plan_seconds: float
    candidates: int
    homogeneous: Prediction | None = None
    unused_ranks: tuple[int, ...] = ()

    @property
    def strategy(self) -> Strategy:
        return self.prediction.strategy

    @property
    def options(self) -> StrategyOptions:
        return self.prediction.options

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s

    def to_json(self, cost: CostModel) -> dict[str, Any]:
        def side(p: Prediction) -> dict[str, Any]:
            return {
                "strategy": str(p.strategy),
                "zero1": p.options.zero1,
                "recompute": p.options.recompute,
                "sequence_parallel": p.options.sequence_parallel,
                "micro_batch_size": p.strategy.pipelines[0].micro_batch_size,
                "step_time_s": p.step_time_s,
                "peak_memory_by_kind": p.peak_by_kind(cost),
            }

        out = side(self.prediction)
        out |= {
            "schedule": self.options.schedule,
            "dtype": self.options.dtype,
            "num_ranks": self.strategy.num_ranks,
            "unused_ranks": list(self.unused_ranks),
            "memory_cap_by_kind": {k: d.memory_bytes for k, d in cost.devices.items()},
            "plan_seconds": self.plan_seconds,
            "candidates": self.candidates,
            "homogeneous": side(self.homogeneous) if self.homogeneous else None,
            "speedup_vs_homogeneous": (
                self.homogeneous.step_time_s / self.step_time_s if self.homogeneous else None
            ),
        }
        return out


# -- units and configurations ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Unit:
    kind: str
    ranks: tuple[int, ...]
    node: int


def _nodes(cost: CostModel) -> list[tuple[str, tuple[int, ...]]]:
    out, first = [], 0
    for group in cost.cluster.groups:
        for _ in range(group.count):
            out.append((group.kind, tuple(range(first, first + group.gpus_per_node))))
            first += group.gpus_per_node
    return out


def tp_degrees(config: LlamaConfig, node_sizes: Sequence[int]) -> list[int]:
    """TP degrees that divide every node size given and the model's split dimensions."""
    sizes = (config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size)
    top = min(node_sizes)
    return [
        t for t in range(1, top + 1)
        if all(n % t == 0 for n in node_sizes) and all(x % t == 0 for x in sizes)
    ]  # fmt: skip


def _units(cost: CostModel, kind: str, tp: int) -> list[_Unit]:
    units = []
    for node, (k, ranks) in enumerate(_nodes(cost)):
        if k == kind:
            units += [_Unit(kind, ranks[i : i + tp], node) for i in range(0, len(ranks), tp)]
    return units


@dataclass(frozen=True)
class _Config:
    """Pipelines as lists of units (stage order), one micro-batch size, the options."""

    pipelines: tuple[tuple[_Unit, ...], ...]
    micro_batch_size: int
    options: StrategyOptions
    estimate: float = math.inf
    layers: tuple[tuple[int, ...], ...] = ()


# -- closed-form costs ----------------------------------------------------------------------


class _Costs:
    """Cached per-stage cost lines: seconds and bytes as ``slope * layers + constant``."""

    def __init__(
        self, cost: CostModel, config: LlamaConfig, seq_len: int, global_batch: int
    ) -> None:
        self.cost, self.config, self.seq_len, self.global_batch = (
            cost,
            config,
            seq_len,
            global_batch,
        )
        self.work = lru_cache(maxsize=None)(self._work)
        self.memory = lru_cache(maxsize=None)(self._memory)
        self._lines: dict[tuple[Any, ...], tuple[float, float]] = {}
        self._sends: dict[tuple[Any, ...], float] = {}

    def _work(
        self, ranks: tuple[int, ...], layers: int, mbs: int, first: bool, last: bool,
        recompute: bool, sp: bool,
    ) -> StageWork:  # fmt: skip
        return stage_work(
            self.cost, self.config, ranks, layers, micro_batch_size=mbs, seq_len=self.seq_len,
            first=first, last=last, recompute=recompute, sequence_parallel=sp,
        )  # fmt: skip

    def line(
        self, unit: _Unit, mbs: int, first: bool, last: bool, options: StrategyOptions,
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

    def send(self, a: _Unit, b: _Unit, mbs: int) -> float:
        key = (a.kind, min(len(a.ranks), len(b.ranks)), a.node == b.node, mbs)
        if key not in self._sends:
            nbytes = mbs * self.seq_len * self.config.hidden_size * self.cost.element_bytes
            self._sends[key] = self.cost.send(nbytes / key[1], a.ranks[0], b.ranks[0])
        return self._sends[key]

    def stage_lines(
        self, units: Sequence[_Unit], mbs: int, m: int, replicas: int, options: StrategyOptions,
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
        self, units: Sequence[_Unit], layers: Sequence[float], d: int, options: StrategyOptions,
    ) -> float:  # fmt: skip
        """Gradient sync (over the inter-node link) and Adam of the slowest stage."""
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


def _water_fill(
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


@dataclass
class _Shortfall:
    """The smallest memory shortfall seen: the best hint when nothing fits."""

    gap: float = math.inf
    kind: str = ""
    needed: float = 0.0
    available: float = 0.0

    def see(self, kind: str, needed: float, available: float) -> None:
        if needed - available < self.gap:
            self.gap, self.kind, self.needed, self.available = (
                needed - available, kind, needed, available,
            )  # fmt: skip


DENSE_UNITS = 64  # up to this many units every pipeline count is tried


def _pipeline_counts(units: dict[str, list[_Unit]], global_batch: int) -> list[int]:
    """Pipeline counts to try: all of them on small clusters; on big ones the counts that
    divide some kind's units, and powers of two (a leftover of a few units then idles)."""
    top = min(max(len(u) for u in units.values()), global_batch)
    if sum(len(u) for u in units.values()) <= DENSE_UNITS:
        return list(range(1, top + 1))
    keep = {d for d in range(1, top + 1) if any(len(u) % d == 0 for u in units.values())}
    keep |= {2**i for i in range(top.bit_length()) if 2**i <= top}
    return sorted(keep)


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (p < extra) for p in range(parts)]


class _Search:
    def __init__(
        self, config: LlamaConfig, cost: CostModel, global_batch: int, seq_len: int,
        zero1: Zero1, dtype: Literal["bf16", "fp32"], time_limit: float | None,
    ) -> None:  # fmt: skip
        self.config, self.cost, self.B, self.seq_len = config, cost, global_batch, seq_len
        self.zero1, self.dtype, self.time_limit = zero1, dtype, time_limit
        self.costs = _Costs(cost, config, seq_len, global_batch)
        self.shortfall = _Shortfall()
        self.count = 0
        self._shapes: dict[Any, tuple[float, tuple[int, ...]] | None] = {}
        self._lines: dict[Any, Any] = {}

    def options(self, d: int, tps: Sequence[int], recompute: bool) -> StrategyOptions:
        zero = self.zero1 == "on" or (self.zero1 == "auto" and d > 1)
        sp = max(tps) > 1 and all(self.seq_len % t == 0 for t in tps)
        return StrategyOptions(
            zero1=zero, sequence_parallel=sp, recompute=recompute, schedule="1f1b",
            dtype=self.dtype,
        )  # fmt: skip

    # -- level 1 ----------------------------------------------------------------------------

    def layouts(self) -> Iterator[tuple[tuple[tuple[_Unit, ...], ...], tuple[int, ...]]]:
        """Pipelines of units: TP per kind, pipeline count, leftover use, kinds and order."""
        nodes = _nodes(self.cost)
        kinds = list(dict.fromkeys(k for k, _ in nodes))
        sizes = {k: [len(r) for kk, r in nodes if kk == k] for k in kinds}
        degrees = {k: tp_degrees(self.config, sizes[k]) for k in kinds}
        subsets = [s for n in range(len(kinds), 0, -1) for s in itertools.combinations(kinds, n)]
        if len(kinds) > 3:  # all kinds, or all but one
            subsets = [s for s in subsets if len(s) >= len(kinds) - 1]
        for subset in subsets:
            orders = list(itertools.permutations(subset)) if len(subset) <= 3 else [
                tuple(sorted(subset, key=lambda k: -self.cost.device(k).memory_bytes)),
                tuple(sorted(subset, key=lambda k: self.cost.device(k).seconds("matmul", 1e12))),
            ]  # fmt: skip
            for tps in itertools.product(*(degrees[k] for k in subset)):
                units = {k: _units(self.cost, k, t) for k, t in zip(subset, tps, strict=True)}
                for d in _pipeline_counts(units, self.B):
                    spreads = [False]
                    if any(len(u) % d for u in units.values()):
                        spreads.append(True)
                    for spread in spreads:
                        parts = self._deal(units, d, spread)
                        if parts is None:
                            continue
                        for order in orders:
                            pipes = tuple(
                                tuple(u for k in order for u in part[k]) for part in parts
                            )
                            if all(1 <= len(p) <= self.config.num_layers for p in pipes):
                                yield pipes, tps

    @staticmethod
    def _deal(
        units: dict[str, list[_Unit]], d: int, spread: bool
    ) -> list[dict[str, list[_Unit]]] | None:
        parts: list[dict[str, list[_Unit]]] = [{} for _ in range(d)]
        for kind, us in units.items():
            counts = _split(len(us), d) if spread else [len(us) // d] * d
            if not spread and len(us) // d == 0:
                return None
            start = 0
            for p, n in enumerate(counts):
                parts[p][kind] = us[start : start + n]
                start += n
        return parts

    def estimate(
        self, pipes: tuple[tuple[_Unit, ...], ...], tps: Sequence[int], mbs: int
    ) -> _Config | None:
        d = len(pipes)
        counts = _split(self.B // mbs, d)
        for recompute in (False, True):
            options = self.options(d, tps, recompute)
            worst, layers = 0.0, []
            for units, m in zip(pipes, counts, strict=True):
                fill = self._pipeline(units, mbs, m, d, options)
                if fill is None:
                    break
                worst = max(worst, fill[0])
                layers.append(fill[1])
            else:
                self.count += 1
                return _Config(pipes, mbs, options, worst, tuple(layers))
        return None

    def _pipeline(
        self, units: tuple[_Unit, ...], mbs: int, m: int, d: int, options: StrategyOptions
    ) -> tuple[float, tuple[int, ...]] | None:
        """Closed-form time and layers of one pipeline, shared by pipelines of one shape."""
        shape = tuple(
            (u.kind, len(u.ranks), i + 1 < len(units) and units[i + 1].node != u.node)
            for i, u in enumerate(units)
        )
        key = (shape, mbs, m, d, options)
        if key not in self._shapes:
            self._shapes[key] = self._fill(units, mbs, m, d, options)
        return self._shapes[key]

    def _fill(
        self, units: tuple[_Unit, ...], mbs: int, m: int, d: int, options: StrategyOptions
    ) -> tuple[float, tuple[int, ...]] | None:
        shape = tuple(
            (u.kind, len(u.ranks), i + 1 < len(units) and units[i + 1].node != u.node)
            for i, u in enumerate(units)
        )
        key = (shape, mbs, min(m, len(units)), d, options)
        if key not in self._lines:
            self._lines[key] = self.costs.stage_lines(units, mbs, m, d, options)
        a, c, alpha, beta, cap = self._lines[key]
        caps = [
            (cp - bt) / al if al > 0 else float(self.config.num_layers)
            for al, bt, cp in zip(alpha, beta, cap, strict=True)
        ]
        fill = _water_fill(self.config.num_layers, m, a, c, caps)
        if fill is None:
            even = self.config.num_layers / len(units)
            s = max(range(len(units)), key=lambda i: alpha[i] * even + beta[i] - cap[i])
            self.shortfall.see(units[s].kind, alpha[s] * even + beta[s], cap[s])
            return None
        seconds, share = fill
        seconds += self.costs.sync(units, share, d, options)
        return seconds, tuple(round(x) for x in share)

    # -- level 2 ----------------------------------------------------------------------------

    def solve(self, conf: _Config) -> Strategy | None:
        d, mbs = len(conf.pipelines), conf.micro_batch_size
        counts = _split(self.B // mbs, d)
        layers = [
            self._layers(units, m, d, mbs, conf.options)
            for units, m in zip(conf.pipelines, counts, strict=True)
        ]
        if any(x is None for x in layers):
            return None
        tmax, tsum = [], []
        for units, ls in zip(conf.pipelines, layers, strict=True):
            assert ls is not None
            a, c, *_ = self.costs.stage_lines(units, mbs, 1, d, conf.options)
            times = [ai * li + ci for ai, ci, li in zip(a, c, ls, strict=True)]
            tmax.append(max(times))
            tsum.append(sum(times))
        new = micro_batches_per_pipeline(self.B, mbs, tmax, tsum, time_limit=self.time_limit)
        if new is None:
            return None
        if new != counts:
            layers = [
                self._layers(u, m, d, mbs, conf.options)
                for u, m in zip(conf.pipelines, new, strict=True)
            ]
            if any(x is None for x in layers):
                return None
        pipelines = []
        for units, ls, m in zip(conf.pipelines, layers, new, strict=True):
            assert ls is not None
            stages, first = [], 0
            for unit, n in zip(units, ls, strict=True):
                stages.append(Stage(unit.ranks, first, first + n - 1))
                first += n
            pipelines.append(Pipeline(m, mbs, tuple(stages)))
        return Strategy(tuple(pipelines))

    def _layers(
        self, units: tuple[_Unit, ...], m: int, d: int, mbs: int, options: StrategyOptions
    ) -> list[int] | None:
        a, c, alpha, beta, cap = self.costs.stage_lines(units, mbs, m, d, options)
        return layers_per_stage(
            self.config.num_layers, m, a, c, alpha, beta, cap, time_limit=self.time_limit
        )


def _within_headroom(p: Prediction, cost: CostModel) -> bool:
    limit = 1 - PLAN_HEADROOM
    return all(m.peak <= cost.device_of(r).memory_bytes * limit for r, m in p.memory.items())


def _fitting_best(predictions: Sequence[Prediction], cost: CostModel) -> Prediction | None:
    fits = [p for p in predictions if _within_headroom(p, cost)]
    return min(fits, key=lambda p: p.step_time_s) if fits else None


def plan(
    config: LlamaConfig, cost: CostModel, *, global_batch: int, seq_len: int,
    zero1: Zero1 = "auto", dtype: Literal["bf16", "fp32"] = "bf16",
    time_limit: float | None = None, homogeneous: bool = True, keep: int = KEEP,
) -> Plan:  # fmt: skip
    """The fastest strategy the search finds that fits every rank's memory."""
    began = time.perf_counter()
    if global_batch < 1 or seq_len < 1:
        raise PlanError(f"global_batch={global_batch}, seq_len={seq_len}: both must be >= 1")
    search = _Search(config, cost, global_batch, seq_len, zero1, dtype, time_limit)
    best: dict[int, list[tuple[float, int, _Config]]] = {}
    serial = itertools.count()
    for pipes, tps in search.layouts():
        for mbs in MICRO_BATCH_SIZES:
            if global_batch % mbs or global_batch // mbs < len(pipes):
                continue
            conf = search.estimate(pipes, tps, mbs)
            if conf is None:
                continue
            heap = best.setdefault(mbs, [])
            item = (-conf.estimate, next(serial), conf)
            if len(heap) < keep:
                heapq.heappush(heap, item)
            elif item[0] > heap[0][0]:
                heapq.heapreplace(heap, item)
    predictions = []
    kept = sorted((c for heap in best.values() for c in heap), key=lambda x: (-x[0], x[1]))
    for _, _, conf in kept[:KEEP_ALL]:
        strategy = search.solve(conf)
        if strategy is not None:
            predictions.append(
                predict(strategy, config, cost, seq_len=seq_len, options=conf.options)
            )
    chosen = _fitting_best(predictions, cost)
    if chosen is None:
        raise PlanError(_nothing_fits(search.shortfall, cost))
    base = (
        homogeneous_plan(
            config, cost, global_batch=global_batch, seq_len=seq_len, zero1=zero1, dtype=dtype
        )
        if homogeneous
        else None
    )
    used = set(chosen.strategy.ranks)
    unused = tuple(r for r in range(cost.num_ranks) if r not in used)
    return Plan(chosen, time.perf_counter() - began, search.count, base, unused)


def _nothing_fits(short: _Shortfall, cost: CostModel) -> str:
    if not short.kind:
        return (
            f"no strategy for {cost.num_ranks} ranks: no pipeline layout divides the model "
            "(check the TP degrees the model allows and the global batch)"
        )
    gib = 2**30
    return (
        f"nothing fits: the closest plan needs {short.needed / gib:.1f} GiB on a {short.kind} "
        f"rank, which has {short.available / gib:.1f} GiB ({short.needed:.0f} > "
        f"{short.available:.0f} bytes): add devices, shorten seq_len or use a smaller model"
    )


# -- the homogeneous baseline ---------------------------------------------------------------


def megatron_strategy(
    dp: int, tp: int, pp: int, num_layers: int, m: int, mbs: int, *, pipeline_major: bool
) -> Strategy:
    """DP x TP x PP, even layers (first stages take the remainder), Megatron's rank order
    (TP fastest, then DP, then PP) or pipeline-major."""
    counts = sorted(_split(num_layers, pp), reverse=True)
    pipelines = []
    for d in range(dp):
        stages, first = [], 0
        for s, n in enumerate(counts):
            base = (d * pp + s) * tp if pipeline_major else (s * dp + d) * tp
            stages.append(Stage(tuple(range(base, base + tp)), first, first + n - 1))
            first += n
        pipelines.append(Pipeline(m, mbs, tuple(stages)))
    return Strategy(tuple(pipelines))


def homogeneous_plan(
    config: LlamaConfig, cost: CostModel, *, global_batch: int, seq_len: int,
    zero1: Zero1 = "auto", dtype: Literal["bf16", "fp32"] = "bf16", keep: int = 2,
) -> Prediction | None:  # fmt: skip
    """The best Megatron-style plan over every rank, or None when none fits."""
    n = cost.num_ranks
    node_sizes = [g.gpus_per_node for g in cost.cluster.groups]
    costs = _Costs(cost, config, seq_len, global_batch)
    scored: list[tuple[float, int, Strategy, StrategyOptions]] = []
    serial = itertools.count()
    for tp in tp_degrees(config, node_sizes):
        for pp in range(1, min(config.num_layers, n // tp) + 1):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            for mbs in MICRO_BATCH_SIZES:
                if global_batch % (dp * mbs):
                    continue
                m = global_batch // (dp * mbs)
                for recompute in (False, True):
                    options = StrategyOptions(
                        zero1=zero1 == "on" or (zero1 == "auto" and dp > 1),
                        sequence_parallel=tp > 1 and seq_len % tp == 0, recompute=recompute,
                        dtype=dtype,
                    )  # fmt: skip
                    for major in (False, True):
                        s = megatron_strategy(
                            dp, tp, pp, config.num_layers, m, mbs, pipeline_major=major
                        )
                        scored.append((_closed_form(s, costs, options), next(serial), s, options))
    scored.sort(key=lambda x: x[:2])
    predictions = []
    for _, _, strategy, options in scored:
        p = predict(strategy, config, cost, seq_len=seq_len, options=options)
        if _within_headroom(p, cost):
            predictions.append(p)
            if len(predictions) >= keep:
                break
    return _fitting_best(predictions, cost)


def _closed_form(strategy: Strategy, costs: _Costs, options: StrategyOptions) -> float:
    """The 1F1B formula on a given strategy (used to rank candidates before simulating)."""
    worst = 0.0
    d = len(strategy.pipelines)
    for pipe in strategy.pipelines:
        count = len(pipe.stages)
        times, units = [], []
        for s, stage in enumerate(pipe.stages):
            w = costs.work(stage.ranks, len(stage.layers), pipe.micro_batch_size, s == 0,
                           s == count - 1, options.recompute, options.sequence_parallel)  # fmt: skip
            times.append(w.forward_s + w.backward_s)
            units.append(_Unit(costs.cost.kind_of(stage.ranks[0]), stage.ranks, 0))
        t = (pipe.num_micro_batches - 1) * max(times) + sum(times)
        t += costs.sync(units, [len(st.layers) for st in pipe.stages], d, options)
        worst = max(worst, t)
    return worst
