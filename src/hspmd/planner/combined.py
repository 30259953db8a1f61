"""One planner for heterogeneous ranks, failures and mixed lengths (issue 39).

``LengthPlanner(config, cost).plan(hist, alive=..., previous=...)`` gives the length-aware
set of strategies (one per maximum length, as ``hspmd plan --data``) for exactly the
``alive`` ranks of ``cost``'s cluster, whose kinds may differ in speed and memory (a slowed
rank is a kind of its own: ``local_cost(..., slowdown=)``), under the elastic constraints
(every pipeline holds every layer, at least ``min_replicas`` pipelines, ZeRO off: one lost
rank never takes the last copy of a state). It composes the two planners' parts:

- the length planner's row model (``PipeModel``: ``o + a tokens + q squares`` per row),
  per GPU kind, on a cluster of that kind alone (``pipe_configs``);
- its DP over length intervals, with the GPUs of each kind as the budget (the state is
  the ranks used per kind and the pipelines so far, capped at ``min_replicas``)::

      f[j][used] = min over i <= j, kind k, configuration c of k, count n, row length R:
                   max(f[i-1][used - n gpus(c) on k], T_c(bins i..j over n pipelines))

- the choice on sample steps (``sampled_seconds``, dispatched into fixed micro-batches);
- the elastic planner's warm start: the previous set's pipelines whose ranks survived keep
  their ranks when the new set has a pipeline of their kind and shape
  (``hspmd.planner.placement``), the previous strategy repaired (pipelines that lost a
  rank dropped) competes on the samples, and the switch between strategies is the fused
  BSR of fp32 masters and Adam moments (``planner.elastic.switch_estimate``).

Warm also means fast: the row models are the costly part (memory and work per
configuration) and depend on the kind, not on which ranks are alive; a ``LengthPlanner``
keeps them, so a re-plan after a failure runs only the DPs, the placement and the samples.

>>> from hspmd.models.config import get_config
>>> from hspmd.planner.local import local_cost
>>> from hspmd.planner.length_model import Histogram
>>> planner = LengthPlanner(get_config("llama-tiny"), local_cost(4, slowdown={3: 3.0}))
>>> hist = Histogram.of([20] * 30 + [60] * 4, max_len=64, smallest=16)
>>> s = planner.plan(hist, alive=range(4), step_tokens=256, count=2)
>>> all(len(p.strategy.pipelines) >= 2 for p in s.plans), s.alive
(True, (0, 1, 2, 3))
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hspmd.cost.lines import CostModel
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import Pipeline, Stage, Strategy, StrategyOptions, uniform_recompute
from hspmd.planner.closed_form import split_evenly
from hspmd.planner.elastic import switch_estimate
from hspmd.planner.length_candidates import sampled_seconds
from hspmd.planner.length_model import (
    Histogram,
    LengthPlanError,
    LengthStrategy,
    PipeModel,
    PipeSpec,
    pipe_configs,
    sync_seconds,
)
from hspmd.planner.lengths import _interval_seconds, _longest, _undominated, option_sets
from hspmd.planner.placement import Home, place

__all__ = ["MARGIN", "LengthPlanner", "LengthSet", "StatesSwitch", "repaired"]

MARGIN = 0.02  # a kept (repaired) strategy within 2 % of the best wins: nothing moves
FINALS = 8  # DP end states tried by the placement, fastest first
SPLIT_STEPS = 12  # bisection steps of a load split between two kinds
COMPARED = 8  # samples the kept strategy and the new one are compared on


@dataclass(frozen=True)
class LengthSet:
    """The strategies (cluster rank ids; shortest maximum first), the alive ranks and what
    planning took (the switch costs between them: ``StatesSwitch``, when asked)."""

    plans: tuple[LengthStrategy, ...]
    alive: tuple[int, ...]
    plan_seconds: float  # the set (DPs, placement, samples)
    kept: int  # strategies of the previous set kept (repaired) rather than re-planned


class LengthPlanner:
    """The planner of the module docstring; keeps each kind's row models (warm start)."""

    def __init__(
        self, config: ModelSpec, cost: CostModel, *, sequence_parallel: bool = True,
        min_replicas: int = 2,
    ) -> None:  # fmt: skip
        if min_replicas < 1:
            raise LengthPlanError(f"min_replicas={min_replicas}: give at least 1")
        self.config, self.cost, self.min_replicas = config, cost, min_replicas
        self.base = StrategyOptions(sequence_parallel=sequence_parallel, dtype=cost.dtype)
        self._pools: dict[tuple[str, int], list[PipeModel]] = {}

    def warm(self, max_len: int) -> None:
        """Build every kind's row models now (they are kept for every later ``plan``)."""
        for kind in dict.fromkeys(self.cost.kind_of(r) for r in range(self.cost.num_ranks)):
            self.pool(kind, max_len)

    def pool(self, kind: str, max_len: int) -> list[PipeModel]:
        """Every configuration of ``kind`` (recompute as each needs) that fits a row."""
        key = (kind, max_len)
        if key not in self._pools:
            sub = _kind_cost(self.cost, kind)
            every = [m for o in option_sets(self.base, self.config.num_layers)
                     for m in pipe_configs(self.config, sub, options=o, max_len=max_len)]  # fmt: skip
            self._pools[key] = _undominated(every)
        return self._pools[key]

    def plan(
        self, hist: Histogram, *, alive: Iterable[int], step_tokens: int, count: int = 4,
        samples: Sequence[Sequence[int]] = (), previous: LengthSet | None = None,
    ) -> LengthSet:  # fmt: skip
        """The set for ``alive`` (module docstring); ``previous``: the set running now."""
        began = time.perf_counter()
        ranks = tuple(sorted(set(alive)))
        self.cost.cluster.check_ranks(ranks, what="alive")
        if len(ranks) < self.min_replicas:
            raise LengthPlanError(
                f"{len(ranks)} alive ranks cannot hold {self.min_replicas} pipelines (each "
                "state needs that many holders): add ranks or lower min_replicas"
            )
        free = _free_by_kind(self.cost, ranks)
        out: list[LengthStrategy] = []
        kept = 0
        for k in range(max(0, len(hist.edges) - count), len(hist.edges)):
            if k < len(hist.edges) - 1 and not any(hist.counts[k:]):
                continue
            cut = hist.upto(k)
            homes = _homes(self.cost, previous, cut.max_len)
            found = self._dp_plan(cut, free, step_tokens, homes)
            old = _repaired_for(previous, cut.max_len, ranks, self)
            best, is_old = _choose(found, old, samples, low=hist.edges[k - 1] if k else 0)
            if best is None:
                if k == len(hist.edges) - 1:
                    raise LengthPlanError(self._none_message(ranks, hist.max_len))
                continue
            kept += is_old
            if out and str(out[-1].strategy) == str(best.strategy):
                out[-1] = best  # the same pipelines serve the longer maximum
                continue
            out.append(best)
        return LengthSet(tuple(out), ranks, time.perf_counter() - began, kept)

    def _dp_plan(
        self, hist: Histogram, free: dict[str, dict[int, list[int]]], step_tokens: int,
        homes: Sequence[Home],
    ) -> LengthStrategy | None:  # fmt: skip
        """The fastest DP result that the placement can put on the alive ranks."""
        pools = {kind: [m for m in self.pool(kind, hist.max_len)
                        if m.config.tp * m.config.cp <= max(map(len, nodes.values()))]
                 for kind, nodes in free.items()}  # fmt: skip
        caps = {kind: sum(map(len, nodes.values())) for kind, nodes in free.items()}
        for seconds, pipes in _dp(hist, pools, caps, step_tokens, self.min_replicas):
            shapes = [(kind, spec.model.config) for kind, spec, _ in pipes]
            stages = place(shapes, free, homes=homes)
            if stages is None:
                continue
            specs = [spec for _, spec, _ in pipes]
            strategy = _strategy(specs, stages, self.config.num_layers)
            return self._finish(hist.max_len, specs, [iv for *_, iv in pipes], strategy, seconds)
        return None

    def _finish(
        self, max_len: int, specs: Sequence[PipeSpec], intervals: Sequence[tuple[int, int]],
        strategy: Strategy, seconds: float,
    ) -> LengthStrategy:  # fmt: skip
        strategy, options = uniform_recompute(strategy, self.base)
        sync = sync_seconds(strategy, self.config, self.cost)
        return LengthStrategy(max_len, tuple(specs), tuple(intervals), seconds + sync, sync,
                              strategy, options)  # fmt: skip

    def _none_message(self, ranks: Sequence[int], max_len: int) -> str:
        return (
            f"no length-aware strategy for the {len(ranks)} alive ranks: {self.min_replicas} "
            f"pipelines holding every layer (ZeRO off) with rows of {max_len} tokens do not "
            "fit their memory: add ranks, lower --max-seq-len or lower min_replicas"
        )


Chosen = tuple[str, PipeSpec, tuple[int, int]]  # kind, pipeline, its length range


Part = tuple[int, int, int, int, float]  # kind index, model, count, row length, load share
Move = tuple[float, tuple[int, ...], int, tuple[Part, ...]]  # seconds, ranks per kind, pipes


def _dp(
    hist: Histogram, pools: dict[str, list[PipeModel]], caps: dict[str, int],
    step_tokens: int, min_pipes: int,
) -> list[tuple[float, list[Chosen]]]:  # fmt: skip
    """The DP of the module docstring: up to ``FINALS`` end states (ranks used per kind,
    at least ``min_pipes`` pipelines), fastest first, each with its pipelines."""
    kinds, K = tuple(pools), len(hist.edges)
    limit = tuple(caps[k] for k in kinds)
    per = [hist.per_step(k, step_tokens) for k in range(K)]
    State = tuple[int, ...]  # ranks used per kind, then pipelines (capped at min_pipes)
    f: list[dict[State, tuple[float, tuple | None]]] = [{} for _ in range(K + 1)]
    f[0][(0,) * len(kinds) + (0,)] = (0.0, None)
    for j in range(1, K + 1):
        for i in range(1, j + 1):
            docs, tokens, squares = (sum(per[b][x] for b in range(i - 1, j)) for x in range(3))
            if (tokens <= 0 and i < j) or not f[i - 1]:
                continue
            moves = _moves(hist, per, pools, caps, kinds, (i, j), (docs, tokens, squares))
            for state, (before, _) in f[i - 1].items():
                for t, added, pipes, parts in moves:
                    used = tuple(u + a for u, a in zip(state[:-1], added, strict=True))
                    if any(u > c for u, c in zip(used, limit, strict=True)):
                        continue
                    new = (*used, min(state[-1] + pipes, min_pipes))
                    value = max(before, t)
                    if new not in f[j] or value < f[j][new][0] - 1e-12:
                        f[j][new] = (value, (i, state, parts))
    ends = sorted((v[0], sum(s[:-1]), s) for s, v in f[K].items() if s[-1] >= min_pipes)
    return [(t, _walk(f, hist, per, pools, kinds, s)) for t, _, s in ends[:FINALS]]


def _moves(
    hist: Histogram, per: Sequence[tuple[float, float, float]], pools: dict[str, list[PipeModel]],
    caps: dict[str, int], kinds: tuple[str, ...], span: tuple[int, int],
    load: tuple[float, float, float],
) -> list[Move]:  # fmt: skip
    """Every way to serve bins ``span`` (1-based, inclusive): ``count`` pipelines of one
    configuration; and, where kinds differ, the fastest configuration of each kind per rank
    count side by side, the load split so that both finish together (``_split``)."""
    j = span[1]
    longest = _longest(hist, per, j - 1)
    out: list[Move] = []
    best: dict[tuple[int, int], Move] = {}  # (kind, ranks) -> its fastest single move
    for c, kind in enumerate(kinds):
        for mi, model in enumerate(pools[kind]):
            size = model.config.gpus
            for row_len in hist.edges[j - 1 :]:
                if row_len > model.fit_len:
                    break
                for n in range(1, caps[kind] // size + 1):
                    t = _interval_seconds(model, n, row_len, *load, longest)
                    added = tuple(n * size if k == c else 0 for k in range(len(kinds)))
                    move = (t, added, n, ((c, mi, n, row_len, 1.0),))
                    out.append(move)
                    if (c, n * size) not in best or t < best[c, n * size][0]:
                        best[c, n * size] = move
    for (ca, _), a in best.items():
        for (cb, _), b in best.items():
            if ca < cb:
                out += _split(a, b, pools, kinds, load, longest)
    return out


def _split(
    a: Move, b: Move, pools: dict[str, list[PipeModel]], kinds: tuple[str, ...],
    load: tuple[float, float, float], longest: float,
) -> list[Move]:  # fmt: skip
    """``a`` and ``b`` (of two kinds) sharing one interval: the share ``x`` of its load on
    ``a`` where both take as long (bisection: ``a``'s time grows with ``x``, ``b``'s
    falls); none unless faster than either alone."""
    (pa,), (pb,) = a[3], b[3]

    def seconds(part: Part, share: float) -> float:
        c, mi, n, row_len, _ = part
        model = pools[kinds[c]][mi]
        docs, tokens, squares = (x * share for x in load)
        return _interval_seconds(model, n, row_len, docs, tokens, squares, longest)

    lo, hi = 0.0, 1.0
    for _ in range(SPLIT_STEPS):
        x = (lo + hi) / 2
        if seconds(pa, x) < seconds(pb, 1 - x):
            lo = x
        else:
            hi = x
    x = (lo + hi) / 2
    t = max(seconds(pa, x), seconds(pb, 1 - x))
    if t >= min(a[0], b[0]) - 1e-12:
        return []
    added = tuple(p + q for p, q in zip(a[1], b[1], strict=True))
    return [(t, added, a[2] + b[2], ((*pa[:4], x), (*pb[:4], 1 - x)))]


def _walk(
    f: list[dict], hist: Histogram, per: Sequence[tuple[float, float, float]],
    pools: dict[str, list[PipeModel]], kinds: tuple[str, ...], end: tuple[int, ...],
) -> list[Chosen]:  # fmt: skip
    """The pipelines of DP end state ``end``, largest first (as ``plan_lengths``)."""
    out: list[Chosen] = []
    j, state = len(hist.edges), end
    while j > 0:
        back = f[j][state][1]
        assert back is not None
        i, state, parts = back
        lo = 1 if i == 1 else hist.edges[i - 2] + 1
        for c, mi, n, row_len, share in parts:
            x = share * sum(per[b][1] for b in range(i - 1, j)) / n
            d = share * sum(per[b][0] for b in range(i - 1, j)) / n
            rows = max(1, min(math.ceil(x / row_len), math.ceil(d)))
            spec = PipeSpec(pools[kinds[c]][mi], row_len, rows + 1)  # room for fuller steps
            out += [(kinds[c], spec, (lo, hist.edges[j - 1]))] * n
        j = i - 1
    return sorted(out, key=lambda p: (-p[1].model.config.gpus, -p[1].row_len))


def _strategy(
    specs: Sequence[PipeSpec], stages: Sequence[tuple[tuple[int, ...], ...]], num_layers: int
) -> Strategy:
    """``specs`` on the placed ranks, layers split evenly, recompute marked per stage."""
    pipelines = []
    for spec, ranks in zip(specs, stages, strict=True):
        c, redo, first, out = spec.model.config, spec.model.redo, 0, []
        for count, stage_ranks in zip(split_evenly(num_layers, c.pp), ranks, strict=True):
            rc = min(redo, count) if redo else None
            out.append(Stage(stage_ranks, first, first + count - 1, cp=c.cp, recompute=rc))
            first += count
        pipelines.append(Pipeline(spec.micro_batches, 1, tuple(out)))
    return Strategy(tuple(pipelines))


def _kind_cost(cost: CostModel, kind: str) -> CostModel:
    """The cost model of ``cost``'s nodes of ``kind`` alone (its row models' cluster)."""
    cluster = cost.cluster
    sub = dataclasses.replace(
        cluster, name=f"{cluster.name}/{kind}", kinds=(cluster.kind(kind),),
        groups=tuple(g for g in cluster.groups if g.kind == kind),
    )  # fmt: skip
    return CostModel.of(sub, dtype=cost.dtype)


def _free_by_kind(cost: CostModel, ranks: Sequence[int]) -> dict[str, dict[int, list[int]]]:
    out: dict[str, dict[int, list[int]]] = {}
    for r in ranks:
        out.setdefault(cost.kind_of(r), {}).setdefault(cost.node_of(r), []).append(r)
    return out


def _previous_plan(previous: LengthSet | None, max_len: int) -> LengthStrategy | None:
    """The previous set's strategy for ``max_len`` (the shortest maximum holding it)."""
    if previous is None:
        return None
    fits = [p for p in previous.plans if p.max_len >= max_len]
    return min(fits, key=lambda p: p.max_len) if fits else previous.plans[-1]


def _homes(cost: CostModel, previous: LengthSet | None, max_len: int) -> list[Home]:
    """The previous strategy's pipelines for ``max_len``, as homes for the placement."""
    old = _previous_plan(previous, max_len)
    if old is None:
        return []
    return [(cost.kind_of(pipe.stages[0].ranks[0]), spec.model.config,
             tuple(st.ranks for st in pipe.stages))
            for spec, pipe in zip(old.pipes, old.strategy.pipelines, strict=True)]  # fmt: skip


def repaired(plan: LengthStrategy, alive: Iterable[int]) -> tuple[list[int], Strategy]:
    """The pipelines of ``plan`` whose ranks are all in ``alive``: their indices and the
    strategy of them alone."""
    keep = set(alive)
    index = [p for p, pipe in enumerate(plan.strategy.pipelines) if set(pipe.ranks) <= keep]
    return index, Strategy(tuple(plan.strategy.pipelines[p] for p in index))


def _repaired_for(
    previous: LengthSet | None, max_len: int, ranks: Sequence[int], planner: LengthPlanner
) -> LengthStrategy | None:
    """The previous strategy for ``max_len`` without the pipelines that lost a rank (None
    when fewer than ``min_replicas`` are left, or nothing was lost and none joined)."""
    old = _previous_plan(previous, max_len)
    if old is None or old.max_len != max_len:
        return None
    index, strategy = repaired(old, ranks)
    if len(index) < planner.min_replicas:
        return None
    specs = [old.pipes[p] for p in index]
    return planner._finish(max_len, specs, [old.intervals[p] for p in index], strategy,
                           old.predicted_s - old.sync_s)  # fmt: skip


def _times(plan: LengthStrategy, served: Sequence[Sequence[int]]) -> list[float]:
    """Predicted seconds of ``plan`` on each sample (inf: it cannot take it)."""
    return [sampled_seconds(plan, [s]) for s in served]


def _choose(
    found: LengthStrategy | None, old: LengthStrategy | None,
    samples: Sequence[Sequence[int]], *, low: int,
) -> tuple[LengthStrategy | None, bool]:  # fmt: skip
    """The DP's result or the repaired previous strategy: on the samples this maximum
    serves (their longest document over ``low``; at most ``COMPARED``), the previous one
    if it takes every sample the new one takes and is within ``MARGIN`` of it on them
    (nothing moves), else the new one. Without samples or a previous one: the DP's."""
    if old is None or found is None:
        return (found, False) if found is not None else (old, old is not None)
    fit = [s for s in samples if s and max(s) <= found.max_len]
    served = ([s for s in fit if max(s) > low] or fit)[:COMPARED]
    if not served:
        return found, False
    new_t, old_t = _times(found, served), _times(old, served)
    both = [(n, o) for n, o in zip(new_t, old_t, strict=True) if n < math.inf]
    if not both or any(o == math.inf for _, o in both):
        return (found, False) if both else (old, True)
    new_s, old_s = (sum(x) / len(both) for x in zip(*both, strict=True))
    return (old, True) if old_s <= new_s * (1 + MARGIN) else (found, False)


class StatesSwitch:
    """``switch(i, j)``: the predicted fused BSR of fp32 masters and Adam moments from
    strategy ``i`` of ``plans`` to ``j`` (an elastic run switches states: they keep two
    holders), estimated when first asked and kept (a run asks only from the strategy it
    runs)."""

    def __init__(self, plans: Sequence[LengthStrategy], config: ModelSpec, cost: CostModel):
        self.plans, self.config, self.cost = plans, config, cost
        self._seconds: dict[tuple[int, int], float] = {}

    def __call__(self, i: int, j: int) -> float:
        if i == j:
            return 0.0
        if (i, j) not in self._seconds:
            a, b = self.plans[i].strategy, self.plans[j].strategy
            estimate = switch_estimate(a, b, self.config, self.cost, dead=())
            self._seconds[i, j] = estimate.seconds
        return self._seconds[i, j]

    def matrix(self) -> list[list[float]]:
        """Every pair (the plans file's ``switch_s``)."""
        n = len(self.plans)
        return [[self(i, j) for j in range(n)] for i in range(n)]
