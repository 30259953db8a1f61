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

Elastic restrictions (``hspmd.planner.elastic``): ``ranks`` limits the search to a subset
of the cluster (the alive ranks); a node left with fewer ranks than ``t_k`` keeps its
whole TP groups and splits the rest into smaller valid degrees (7 ranks at ``t = 4``:
``4 + 2 + 1``, the paper's C2) or leaves it idle; ``min_pipelines`` drops layouts with
fewer pipelines (data-parallel redundancy); ``seeds`` are layouts that always reach level 2
(a warm start: the current plan repaired).

Level 2, for the survivors: the ILPs of ``hspmd.planner.ilp`` (layers per stage, then
micro-batches per pipeline, then layers again for each pipeline's count), then the
discrete-event simulation of the resulting strategy (``hspmd.planner.predict``); the
fastest simulated plan that fits memory wins, the homogeneous baseline among them (so a
plan is never slower than it in the simulator, where the ILPs' closed form misjudges). A
plan found with recompute recomputes, per stage, only the first layers its memory needs
(``hspmd.planner.trim``: ``:RC<k>``).

The homogeneous baseline is Megatron's: DP x TP x PP over every rank, even layers, one
micro-batch size, ranks in Megatron's order (TP, then DP, then PP) or pipeline-major,
simulated by the same simulator.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hspmd.cost.lines import CostModel
from hspmd.cost.stage import trains_sequence_parallel
from hspmd.errors import HspmdError
from hspmd.gcpause import paused_gc
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import Pipeline, Stage, Strategy, StrategyOptions
from hspmd.planner.closed_form import (
    MICRO_BATCH_SIZES,
    StageCosts,
    Unit,
    fastest_fitting,
    node_ranks,
    split_evenly,
    tp_degrees,
    water_fill,
    within_headroom,
)
from hspmd.planner.homogeneous import homogeneous_plan, megatron_strategy
from hspmd.planner.ilp import layers_per_stage, micro_batches_per_pipeline
from hspmd.planner.predict import Predicted, Prediction
from hspmd.planner.zero_choice import zero_predictions, zero_stages

__all__ = [
    "Layout",
    "Plan",
    "PlanError",
    "homogeneous_plan",
    "megatron_strategy",
    "plan",
    "tp_degrees",
]

Zero1 = Literal["auto", "on", "off"]
Layout = tuple[tuple[Unit, ...], ...]  # pipelines of units, in stage order
KEEP = 4  # configurations per micro-batch size that reach the ILPs and the simulator
KEEP_ALL = 6  # ... and in all


class PlanError(HspmdError, ValueError):
    """No plan fits, or the request cannot be planned (bad batch, bad options)."""


@dataclass(frozen=True)
class Plan(Predicted):
    """The chosen strategy, its options, the simulated step and the homogeneous baseline."""

    prediction: Prediction
    plan_seconds: float
    candidates: int
    homogeneous: Prediction | None = None
    unused_ranks: tuple[int, ...] = ()
    alternatives: tuple[Prediction, ...] = ()  # every simulated plan that fits, fastest first

    def to_json(self, cost: CostModel) -> dict[str, Any]:
        out = self.prediction.plan_json(cost)
        out |= {
            "schedule": self.options.schedule,
            "dtype": self.options.dtype,
            "num_ranks": self.strategy.num_ranks,
            "unused_ranks": list(self.unused_ranks),
            "memory_cap_by_kind": {k: d.memory_bytes for k, d in cost.devices.items()},
            "plan_seconds": self.plan_seconds,
            "candidates": self.candidates,
            "homogeneous": self.homogeneous.plan_json(cost) if self.homogeneous else None,
            "speedup_vs_homogeneous": (
                self.homogeneous.step_time_s / self.step_time_s if self.homogeneous else None
            ),
        }
        return out


@dataclass(frozen=True)
class _Config:
    """Pipelines as lists of units (stage order), one micro-batch size, the options."""

    pipelines: tuple[tuple[Unit, ...], ...]
    micro_batch_size: int
    options: StrategyOptions
    estimate: float = math.inf


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


def _pipeline_counts(units: dict[str, list[Unit]], global_batch: int, least: int = 1) -> list[int]:
    """Pipeline counts to try (at least ``least``): all of them on small clusters; on big
    ones the counts that divide some kind's units, and powers of two (a leftover of a few
    units then idles)."""
    top = min(max(len(u) for u in units.values()), global_batch)
    if sum(len(u) for u in units.values()) <= DENSE_UNITS:
        if least > top:  # only pipelines without some kind can reach it (the joint deal)
            top = min(sum(len(u) for u in units.values()), global_batch)
        return list(range(max(1, least), top + 1))
    keep = {d for d in range(1, top + 1) if any(len(u) % d == 0 for u in units.values())}
    keep |= {2**i for i in range(top.bit_length()) if 2**i <= top}
    return sorted(d for d in keep if d >= least)


def _split_balanced(
    units: Sequence[Unit], d: int, weights: Sequence[float] | None = None
) -> list[int] | None:
    """Counts of ``d`` contiguous runs of ``units`` whose weight totals (default: rank
    counts) are as even as the greedy cut allows (units of unequal TP degrees, a partial
    node, several kinds); None if ``d`` is more than the units."""
    if d > len(units):
        return None
    w = [float(len(u.ranks)) for u in units] if weights is None else list(weights)
    total = sum(w)
    counts, taken, acc = [], 0, 0.0
    for p in range(d):
        left = d - p - 1
        n = 0
        target = total * (p + 1) / d
        while taken + n < len(units) - left and (n == 0 or acc + w[taken + n] / 2 <= target):
            acc += w[taken + n]
            n += 1
        counts.append(n)
        taken += n
    counts[-1] += len(units) - taken
    return counts


class _Search:
    def __init__(
        self, config: ModelSpec, cost: CostModel, global_batch: int, seq_len: int,
        zero1: Zero1, dtype: Literal["bf16", "fp32"], time_limit: float | None,
        ranks: Collection[int] | None = None, min_pipelines: int = 1, *, zero: int | None = None,
    ) -> None:  # fmt: skip
        self.config, self.cost, self.B, self.seq_len = config, cost, global_batch, seq_len
        self.zero1, self.dtype, self.time_limit = zero1, dtype, time_limit
        self.min_pipelines = min_pipelines
        self.zero = zero  # a ZeRO stage asked for (plan(zero=...)); None: chosen per plan
        alive = set(range(cost.num_ranks)) if ranks is None else set(ranks)
        # (kind, alive ranks, node index, full node size) of every node with an alive rank
        self.nodes = [
            (kind, tuple(r for r in node if r in alive), index, len(node))
            for index, (kind, node) in enumerate(node_ranks(cost))
            if any(r in alive for r in node)
        ]
        self.costs = StageCosts(cost, config, seq_len)
        self.sp_ok = trains_sequence_parallel(config)
        self.shortfall = _Shortfall()
        self._ilps: dict[tuple[Any, ...], list[int] | None] = {}
        self.count = 0
        self._shapes: dict[Any, float | None] = {}
        self._lines: dict[Any, Any] = {}

    def options(self, d: int, tps: Sequence[int], recompute: bool) -> StrategyOptions:
        zero = zero_stages(self.zero1, self.zero, d)[0]
        sp = max(tps) > 1 and all(self.seq_len % t == 0 for t in tps) and self.sp_ok
        return StrategyOptions(
            zero=zero, sequence_parallel=sp, recompute=recompute, schedule="1f1b",
            dtype=self.dtype,
        )  # fmt: skip

    # -- level 1 ----------------------------------------------------------------------------

    def units(self, kind: str, tp: int, degrees: Sequence[int], split: bool) -> list[Unit]:
        """TP groups of ``tp`` alive ranks of ``kind`` per node; a partial node's rest split
        into the largest smaller ``degrees`` (``split``) or left idle."""
        out = []
        for k, ranks, node, _ in self.nodes:
            if k != kind:
                continue
            whole = len(ranks) - len(ranks) % tp
            out += [Unit(kind, ranks[i : i + tp], node) for i in range(0, whole, tp)]
            rest = list(ranks[whole:])
            for t in sorted(degrees, reverse=True) if split else ():
                while len(rest) >= t:
                    out.append(Unit(kind, tuple(rest[:t]), node))
                    rest = rest[t:]
        return out

    def layouts(self) -> Iterator[tuple[Layout, tuple[int, ...]]]:
        """Pipelines of units: TP per kind, pipeline count, leftover use, kinds and order."""
        kinds = list(dict.fromkeys(k for k, *_ in self.nodes))
        sizes = {k: [n for kk, _, _, n in self.nodes if kk == k] for k in kinds}
        degrees = {k: tp_degrees(self.config, sizes[k]) for k in kinds}
        partial = any(len(r) < n for _, r, _, n in self.nodes)
        subsets = [s for n in range(len(kinds), 0, -1) for s in itertools.combinations(kinds, n)]
        if len(kinds) > 3:  # all kinds, or all but one
            subsets = [s for s in subsets if len(s) >= len(kinds) - 1]
        for subset in subsets:
            orders = list(itertools.permutations(subset)) if len(subset) <= 3 else [
                tuple(sorted(subset, key=lambda k: -self.cost.device(k).memory_bytes)),
                tuple(sorted(subset, key=lambda k: self.cost.device(k).seconds("matmul", 1e12))),
            ]  # fmt: skip
            for tps, split in itertools.product(
                itertools.product(*(degrees[k] for k in subset)),
                (True, False) if partial else (True,),
            ):  # fmt: skip
                units = {
                    k: self.units(k, t, degrees[k], split) for k, t in zip(subset, tps, strict=True)
                }
                if not all(units.values()):
                    continue
                for d in _pipeline_counts(units, self.B, self.min_pipelines):
                    spreads = ["even"]
                    if any(len(u) % d for u in units.values()):
                        spreads.append("spread")
                    if any(len({len(x.ranks) for x in u}) > 1 for u in units.values()):
                        spreads.append("balanced")
                    if len(units) > 1 and any(len(u) < d for u in units.values()):
                        spreads.append("joint")  # a kind too few for every pipeline
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

    def _deal(
        self, units: dict[str, list[Unit]], d: int, spread: str
    ) -> list[dict[str, list[Unit]]] | None:
        """Units of each kind to ``d`` pipelines: ``even`` (the same count each, the rest
        idle), ``spread`` (the rest to the first pipelines), ``balanced`` (by rank count);
        ``joint``: all kinds in one run cut by compute speed, so a pipeline may lack a kind
        (needed where a kind has fewer units than pipelines)."""
        parts: list[dict[str, list[Unit]]] = [{} for _ in range(d)]
        if spread == "joint":
            flat = [u for us in units.values() for u in us]
            speed = {k: 1 / self.cost.device(k).seconds("matmul", 1e12) for k in units}
            counts = _split_balanced(flat, d, [len(u.ranks) * speed[u.kind] for u in flat])
            if counts is None:
                return None
            start = 0
            for p, n in enumerate(counts):
                for kind in units:
                    parts[p][kind] = [u for u in flat[start : start + n] if u.kind == kind]
                start += n
            return parts
        for kind, us in units.items():
            if spread == "balanced":
                balanced = _split_balanced(us, d)
                if balanced is None:
                    return None
                counts = balanced
            else:
                counts = split_evenly(len(us), d) if spread == "spread" else [len(us) // d] * d
            if spread == "even" and len(us) // d == 0:
                return None
            start = 0
            for p, n in enumerate(counts):
                parts[p][kind] = us[start : start + n]
                start += n
        return parts

    def estimate(self, pipes: Layout, tps: Sequence[int], mbs: int) -> _Config | None:
        d = len(pipes)
        counts = split_evenly(self.B // mbs, d)
        for recompute in (False, True):  # ZeRO 2 and 3: per plan, at level 2 (zero_choice)
            options = self.options(d, tps, recompute)
            worst = 0.0
            for units, m in zip(pipes, counts, strict=True):
                seconds = self._pipeline(units, mbs, m, d, options)
                if seconds is None:
                    break
                worst = max(worst, seconds)
            else:
                self.count += 1
                return _Config(pipes, mbs, options, worst)
        return None

    def _pipeline(
        self, units: tuple[Unit, ...], mbs: int, m: int, d: int, options: StrategyOptions
    ) -> float | None:
        """Closed-form time of one pipeline, shared by pipelines of one shape (unit kinds,
        TP degrees, which neighbours cross a node boundary)."""
        shape = tuple(
            (u.kind, len(u.ranks), i + 1 < len(units) and units[i + 1].node != u.node)
            for i, u in enumerate(units)
        )
        key = (shape, mbs, m, d, options)
        if key not in self._shapes:
            self._shapes[key] = self._fill(units, shape, mbs, m, d, options)
        return self._shapes[key]

    def _fill(
        self, units: tuple[Unit, ...], shape: tuple[Any, ...], mbs: int, m: int, d: int,
        options: StrategyOptions,
    ) -> float | None:  # fmt: skip
        # the lines depend on m only through the in-flight counts min(S - s, m)
        key = (shape, mbs, min(m, len(units)), d, options)
        if key not in self._lines:
            self._lines[key] = self.costs.stage_lines(units, mbs, m, d, options)
        a, c, alpha, beta, cap = self._lines[key]
        caps = [
            (cp - bt) / al if al > 0 else float(self.config.num_layers)
            for al, bt, cp in zip(alpha, beta, cap, strict=True)
        ]
        fill = water_fill(self.config.num_layers, m, a, c, caps)
        if fill is None:
            even = self.config.num_layers / len(units)
            s = max(range(len(units)), key=lambda i: alpha[i] * even + beta[i] - cap[i])
            self.shortfall.see(units[s].kind, alpha[s] * even + beta[s], cap[s])
            return None
        seconds, share = fill
        return seconds + self.costs.sync(units, share, d, options)

    # -- level 2 ----------------------------------------------------------------------------

    def solve(self, conf: _Config) -> Strategy | None:
        d, mbs = len(conf.pipelines), conf.micro_batch_size
        counts = split_evenly(self.B // mbs, d)
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
        self, units: tuple[Unit, ...], m: int, d: int, mbs: int, options: StrategyOptions
    ) -> list[int] | None:
        """The layers ILP of one pipeline, solved once per distinct input: the pipelines of
        a layout over identical nodes pose the same ILP (at 4096 ranks, 1,728 solves of 6
        distinct ones)."""
        a, c, alpha, beta, cap = self.costs.stage_lines(units, mbs, m, d, options)
        key = (m, *map(tuple, (a, c, alpha, beta, cap)))
        if key not in self._ilps:
            self._ilps[key] = layers_per_stage(
                self.config.num_layers, m, a, c, alpha, beta, cap, time_limit=self.time_limit
            )
        found = self._ilps[key]
        return None if found is None else list(found)


@paused_gc()  # millions of objects that live on: hspmd.gcpause
def plan(
    config: ModelSpec, cost: CostModel, *, global_batch: int, seq_len: int,
    zero1: Zero1 = "auto", dtype: Literal["bf16", "fp32"] = "bf16",
    time_limit: float | None = None, homogeneous: bool = True, keep: int = KEEP,
    ranks: Collection[int] | None = None, min_pipelines: int = 1, seeds: Sequence[Layout] = (),
    zero: int | None = None, uneven_shares: bool = True,
) -> Plan:  # fmt: skip
    """The fastest strategy the search finds that fits every rank's memory, with the ZeRO
    stage and shares chosen per plan (``zero``: that stage only; else as ``zero1`` allows,
    ``hspmd.planner.zero_choice.zero_stages``; ``uneven_shares``: memory-proportional
    shares considered where the replicas' devices differ).

    ``ranks`` restricts it to those cluster ranks (default: all), ``min_pipelines`` to
    layouts with at least that many pipelines, and every layout of ``seeds`` is solved and
    simulated whatever its closed-form estimate (see the module docstring)."""
    began = time.perf_counter()
    if global_batch < 1 or seq_len < 1:
        raise PlanError(f"global_batch={global_batch}, seq_len={seq_len}: both must be >= 1")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise PlanError(f"zero={zero}: choose a ZeRO stage 0, 1, 2 or 3, or None (chosen)")
    search = _Search(
        config, cost, global_batch, seq_len, zero1, dtype, time_limit, ranks, min_pipelines,
        zero=zero,
    )  # fmt: skip
    confs = _kept(search, global_batch=global_batch, keep=keep) + _seed_configs(search, seeds)
    predictions = _simulated(search, confs, uneven=uneven_shares)
    seen = {(p.strategy, p.options) for p in predictions}
    base = (
        homogeneous_plan(
            config, cost, global_batch=global_batch, seq_len=seq_len, zero1=zero1, dtype=dtype
        )
        if homogeneous
        else None
    )
    if (
        base is not None
        and ranks is None
        and len(base.strategy.pipelines) >= min_pipelines
        and (base.strategy, base.options) not in seen
    ):
        # even layers are in the search's space, but its ILPs pick layers by the closed
        # form: where the simulator disagrees, the baseline itself may be the faster plan
        predictions.append(base)
    chosen = fastest_fitting(predictions, cost)
    if chosen is None:
        count = cost.num_ranks if ranks is None else len(set(ranks))
        raise PlanError(_nothing_fits(search.shortfall, cost, count))
    used = set(chosen.strategy.ranks)
    pool = range(cost.num_ranks) if ranks is None else sorted(set(ranks))
    unused = tuple(r for r in pool if r not in used)
    fitting = sorted(
        (p for p in predictions if within_headroom(p, cost)), key=lambda p: p.step_time_s
    )
    return Plan(chosen, time.perf_counter() - began, search.count, base, unused, tuple(fitting))


def _kept(search: _Search, *, global_batch: int, keep: int) -> list[_Config]:
    """Level 1: every layout and micro-batch size estimated by the closed form; the ``keep``
    fastest per micro-batch size, then the fastest ``KEEP_ALL`` of those."""
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
    kept = sorted((c for heap in best.values() for c in heap), key=lambda x: (-x[0], x[1]))
    return [conf for _, _, conf in kept[:KEEP_ALL]]


def _simulated(search: _Search, confs: Sequence[_Config], *, uneven: bool) -> list[Prediction]:
    """Level 2: each configuration solved, then simulated under the ZeRO stages and shares
    its memory calls for, recompute trimmed per stage to what each needs (:RC<k>;
    ``hspmd.planner.zero_choice``), bounded by the fastest fitting plan found so far."""
    cost = search.cost
    predictions: list[Prediction] = []
    seen, solved = set(), set()
    for conf in confs:
        strategy = search.solve(conf)
        if strategy is None or (strategy, conf.options) in solved:
            continue
        solved.add((strategy, conf.options))
        stages = zero_stages(search.zero1, search.zero, len(strategy.pipelines))
        fastest = min(
            (p.step_time_s for p in predictions if within_headroom(p, cost)), default=math.inf
        )
        for found in zero_predictions(
            strategy, search.config, cost, seq_len=search.seq_len, options=conf.options,
            stages=stages, uneven=uneven, bound=fastest,
        ):  # fmt: skip
            if (found.strategy, found.options) not in seen:
                seen.add((found.strategy, found.options))
                predictions.append(found)
    return predictions


def _seed_configs(search: _Search, seeds: Sequence[Layout], per_seed: int = 2) -> list[_Config]:
    """The ``per_seed`` best closed-form configurations of each seed layout."""
    out = []
    for pipes in seeds:
        if len(pipes) < search.min_pipelines or not all(pipes):
            continue
        tps = tuple(len(u.ranks) for p in pipes for u in p)
        confs = [
            conf
            for mbs in MICRO_BATCH_SIZES
            if search.B % mbs == 0 and search.B // mbs >= len(pipes)
            for conf in [search.estimate(pipes, tps, mbs)]
            if conf is not None
        ]
        out += sorted(confs, key=lambda c: c.estimate)[:per_seed]
    return out


def _nothing_fits(short: _Shortfall, cost: CostModel, count: int) -> str:
    if not short.kind:
        return (
            f"no strategy for {count} ranks: no pipeline layout divides the model "
            "(check the TP degrees the model allows and the global batch)"
        )
    gib = 2**30
    return (
        f"nothing fits: the closest plan needs {short.needed / gib:.1f} GiB on a {short.kind} "
        f"rank, which has {short.available / gib:.1f} GiB ({short.needed:.0f} > "
        f"{short.available:.0f} bytes): add devices, shorten seq_len or use a smaller model"
    )
