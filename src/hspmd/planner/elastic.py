"""Elastic re-planning: a plan for the ranks alive now, warm-started from the current one.

``replan`` runs the planner's search (``hspmd.planner.search.plan``) restricted to the
alive ranks of the cluster, with the constraints elastic training needs (the paper's
scenario (b), as Oobleck does):

- data-parallel redundancy: at least ``min_replicas`` pipelines, every one holding every
  layer, so each layer has ``min_replicas`` holders and one lost rank never loses a state;
- ZeRO-1 off (a sharded optimizer state would have a single holder);
- every rank within its memory (the planner's headroom).

Warm start. The current strategy *repaired* is always a candidate: its dead ranks removed,
a stage that lost ranks keeps the rest as TP groups of valid degrees (R28-31 without R31
becomes ``R28-29`` and ``R30``, the paper's C2), a stage that lost all its ranks is gone,
and the ILPs re-balance layers and micro-batches. Then among the plans that fit and are
within ``margin`` of the fastest predicted step, the one whose switch moves the fewest
bytes wins (fused BSR of the fp32 masters and both Adam moments, 12 bytes a parameter,
``hspmd.switch.cost``): a plan a hair faster is not worth moving the whole model.

    >>> from hspmd.models.config import get_config
    >>> from hspmd.cost.cluster import load_cluster
    >>> cost = CostModel.of(load_cluster("h20x32"))
    >>> p = replan(get_config("llama-32b"), cost, alive=range(24), current=None,
    ...            global_batch=64, seq_len=4096)
    >>> len(p.strategy.pipelines) >= 2, p.options.zero1
    (True, False)

Errors: ``ElasticPlanError`` (a ``PlanError``) names the alive count, the dead ranks and
what would fit (the fewest ranks ``min_replicas`` replicas need).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from hspmd.comm.bsr import BsrTable
from hspmd.cost.cluster import ClusterError
from hspmd.cost.lines import CostModel
from hspmd.cost.stage import stage_params
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import ParamSpec, state_annotations
from hspmd.plan.strategy import Strategy, format_ranks
from hspmd.planner.closed_form import PLAN_HEADROOM, Unit, tp_degrees
from hspmd.planner.memory import OVERHEAD_BYTES
from hspmd.planner.predict import Predicted, Prediction
from hspmd.planner.search import Layout, PlanError, plan
from hspmd.switch.cost import STATES, estimate_scheme, switch_tables

__all__ = [
    "MARGIN",
    "ElasticPlan",
    "ElasticPlanError",
    "SwitchEstimate",
    "lost_layers",
    "moved_bytes",
    "repair",
    "replan",
    "switch_estimate",
]

MARGIN = 0.02  # plans within 2 % of the fastest predicted step compete on moved bytes
SWITCH_ALGO = "fused"
SWITCH_STATES = "fp32-adam"


class ElasticPlanError(PlanError):
    """No strategy for the alive ranks under the elastic constraints."""


@dataclass(frozen=True, slots=True)
class SwitchEstimate:
    """What switching ``current -> new`` moves: bytes sent over links (local copies free)
    and the predicted seconds of the slowest rank (``hspmd.cost.traffic``)."""

    moved_bytes: float
    seconds: float


@dataclass(frozen=True)
class ElasticPlan(Predicted):
    """The chosen strategy (cluster rank ids), its prediction and what the switch costs.

    ``switch`` is None when there is no current strategy, or when a layer lost every holder
    (``lost_layers``: the states must come from a checkpoint). ``source`` says which
    candidate won: ``"repaired"`` (the current plan, repaired) or ``"search"``."""

    prediction: Prediction
    plan_seconds: float
    alive: tuple[int, ...]
    unused_ranks: tuple[int, ...]
    switch: SwitchEstimate | None
    fastest_step_time_s: float
    source: str
    candidates: int
    lost_layers: tuple[int, ...] = ()

    @property
    def moved_bytes(self) -> float | None:
        return None if self.switch is None else self.switch.moved_bytes

    def to_json(self, cost: CostModel) -> dict[str, Any]:
        return {
            **self.prediction.plan_json(cost),
            "fastest_step_time_s": self.fastest_step_time_s,
            "plan_seconds": self.plan_seconds,
            "alive": format_ranks(self.alive),
            "unused_ranks": list(self.unused_ranks),
            "source": self.source,
            "candidates": self.candidates,
            "moved_bytes": self.moved_bytes,
            "switch_seconds": None if self.switch is None else self.switch.seconds,
            "lost_layers": list(self.lost_layers),
        }


def replan(
    config: ModelSpec, cost: CostModel, *, alive: Iterable[int], current: Strategy | None,
    global_batch: int, seq_len: int, dtype: Literal["bf16", "fp32"] = "bf16",
    min_replicas: int = 2, time_limit: float | None = None, margin: float = MARGIN,
) -> ElasticPlan:  # fmt: skip
    """A strategy over ``alive`` (cluster rank ids of ``cost``) with ``min_replicas``
    pipelines and ZeRO-1 off, warm-started from ``current`` (module docstring)."""
    began = time.perf_counter()
    ranks = _check_alive(alive, cost)
    if min_replicas < 1:
        raise ElasticPlanError(f"min_replicas={min_replicas}: give at least 1")
    if current is not None:
        try:
            cost.cluster.check_ranks(current.ranks, what="the current strategy")
        except ClusterError as error:
            raise ElasticPlanError(str(error)) from None
    alive_set = set(ranks)  # once: a set per rank of current was 65,536 sets of 65,528
    dead = () if current is None else tuple(r for r in current.ranks if r not in alive_set)
    if len(ranks) < min_replicas:
        raise ElasticPlanError(_too_few(config, cost, ranks, dead, min_replicas, dtype))
    if global_batch < min_replicas:
        raise ElasticPlanError(
            f"global_batch={global_batch} cannot feed {min_replicas} data-parallel replicas "
            "(one sample each at least): raise the batch or lower min_replicas"
        )
    seeds: list[Layout] = []
    seed = None if current is None else repair(current, ranks, cost, config)
    if seed is not None:
        seeds.append(seed)
    try:
        found = plan(
            config, cost, global_batch=global_batch, seq_len=seq_len, zero1="off", dtype=dtype,
            time_limit=time_limit, homogeneous=False, ranks=ranks, min_pipelines=min_replicas,
            seeds=seeds,
        )  # fmt: skip
    except PlanError as error:
        raise ElasticPlanError(
            f"{_too_few(config, cost, ranks, dead, min_replicas, dtype)}; the search says: {error}"
        ) from None
    lost = () if current is None else lost_layers(current, ranks, config.num_layers)
    fastest = found.alternatives[0].step_time_s
    close = [p for p in found.alternatives if p.step_time_s <= fastest * (1 + margin)]
    chosen, switch = min(close, key=lambda p: p.step_time_s), None
    if current is not None and not lost:
        chosen, tables = _least_moved(current, close, config, set(dead))
        est = estimate_scheme(tables, SWITCH_ALGO, topology=cost.cluster.topology())
        switch = SwitchEstimate(est.total(), est.time)
    used = set(chosen.strategy.ranks)
    return ElasticPlan(
        prediction=chosen,
        plan_seconds=time.perf_counter() - began,
        alive=ranks,
        unused_ranks=tuple(r for r in ranks if r not in used),
        switch=switch,
        fastest_step_time_s=fastest,
        source="repaired" if seed is not None and _layout_of(chosen.strategy) == _units_key(seed)
        else "search",
        candidates=found.candidates + len(seeds),
        lost_layers=lost,
    )  # fmt: skip


def _layout_of(strategy: Strategy) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple(tuple(st.ranks for st in p.stages) for p in strategy.pipelines)


def _units_key(layout: Layout) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple(tuple(u.ranks for u in p) for p in layout)


def _check_alive(alive: Iterable[int], cost: CostModel) -> tuple[int, ...]:
    ranks = tuple(alive)
    if len(set(ranks)) != len(ranks):
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ElasticPlanError(f"alive lists rank {twice[0]} twice: list each rank once")
    try:
        cost.cluster.check_ranks(ranks, what="alive")
    except ClusterError as error:
        raise ElasticPlanError(str(error)) from None
    return tuple(sorted(ranks))


def repair(
    current: Strategy, alive: Collection[int], cost: CostModel, config: ModelSpec
) -> Layout | None:
    """``current`` without the ranks not in ``alive``, as planner units: a stage keeps its
    alive ranks as TP groups of the largest valid degrees (4 ranks left of 8 at TP 8: one
    group of 4; 3 of 4: 2 + 1), a stage with none is dropped, a pipeline with none too.
    None when nothing of ``current`` is alive."""
    keep = set(alive)
    pipes = []
    for pipeline in current.pipelines:
        units: list[Unit] = []
        for stage in pipeline.stages:
            left = [r for r in stage.ranks if r in keep]
            if not left:
                continue
            kind = cost.kind_of(left[0])
            size = next(g.gpus_per_node for g in cost.cluster.groups if g.kind == kind)
            degrees = sorted(tp_degrees(config, [size]), reverse=True)
            while left:
                t = next(d for d in degrees if d <= len(left))
                units.append(Unit(kind, tuple(left[:t]), cost.node_of(left[0])))
                left = left[t:]
        if units:
            pipes.append(tuple(units[: config.num_layers]))
    return tuple(pipes) or None


def lost_layers(current: Strategy, alive: Collection[int], num_layers: int) -> tuple[int, ...]:
    """Layers some TP shard of which no alive rank of ``current`` holds (a shard of a stage
    of degree t is the t-th part ``[j/t, (j+1)/t)`` of the layer's split dims)."""
    keep = set(alive)
    # (j, t) per shard held: a set, as the replicas hold the same shards (65,536 ranks:
    # a list held each layer's 8,192 copies, sorted as Fractions)
    covered: list[set[tuple[int, int]]] = [set() for _ in range(num_layers)]
    for _, _, stage in current.stages():
        held = {(j, stage.tp) for j, rank in enumerate(stage.ranks) if rank in keep}
        for layer in stage.layers:
            covered[layer] |= held
    return tuple(layer for layer in range(num_layers) if not _covers(covered[layer]))


def _covers(held: set[tuple[int, int]]) -> bool:
    """Whether the shards ``(j, t)``, each ``[j/t, (j+1)/t)``, cover ``[0, 1)``."""
    parts = sorted((Fraction(j, t), Fraction(j + 1, t)) for j, t in held)
    reach = Fraction(0)
    for lo, hi in parts:
        if lo > reach:
            return False
        reach = max(reach, hi)
    return reach >= 1


def _dead(current: Strategy, new: Strategy, dead: Collection[int] | None) -> set[int]:
    return set(current.ranks) - set(new.ranks) if dead is None else set(dead)


def _tables(
    current: Strategy, new: Strategy, config: ModelSpec, failed: set[int],
    before: Mapping[str, ParamSpec] | None = None,
) -> list[BsrTable]:  # fmt: skip
    """The switch's BSR tables (``before``: ``current``'s state annotations, when known)."""
    return switch_tables(
        before if before is not None else state_annotations(current, config),
        state_annotations(new, config),
        itemsize=STATES[SWITCH_STATES],
        failed=failed,
    )


def _least_moved(
    current: Strategy, close: Sequence[Prediction], config: ModelSpec, dead: set[int]
) -> tuple[Prediction, list[BsrTable]]:
    """The plan of ``close`` that moves the fewest bytes from ``current`` (then the fastest,
    then the first) and its switch tables. ``current``'s annotations are built once, and
    one plan alone is chosen without counting its bytes."""
    before = state_annotations(current, config)
    best: tuple[float, float] | None = None
    chosen, kept = close[0], []
    for p in close:
        tables = _tables(current, p.strategy, config, dead, before)
        key = (_table_bytes(tables) if len(close) > 1 else 0.0, p.step_time_s)
        if best is None or key < best:
            best, chosen, kept = key, p, tables
    return chosen, kept


def moved_bytes(
    current: Strategy, new: Strategy, config: ModelSpec, *, dead: Collection[int] | None = None
) -> float:
    """Bytes of masters and Adam moments that must cross a link in ``current -> new``: every
    finest slice once per rank that needs it and does not own it (whatever the scheme). The
    ``dead`` ranks own nothing (default: every rank of ``current`` not in ``new``; an alive
    rank that ``new`` leaves idle can still send)."""
    return _table_bytes(_tables(current, new, config, _dead(current, new, dead)))


def _table_bytes(tables: Sequence[BsrTable]) -> float:
    """``moved_bytes`` of the switch whose tables are ``tables``."""
    total = 0.0
    for table in tables:
        for entry in table.entries:
            missing = len(set(entry.needers) - set(entry.owners))
            if missing:
                total += missing * math.prod(hi - lo for lo, hi in entry.region) * table.itemsize
    return total


def switch_estimate(
    current: Strategy, new: Strategy, config: ModelSpec, cost: CostModel, *,
    dead: Collection[int] | None = None,
) -> SwitchEstimate:  # fmt: skip
    """Bytes and seconds of the fused BSR of masters and Adam moments ``current -> new``
    (``dead`` as in ``moved_bytes``)."""
    failed = _dead(current, new, dead)
    tables = _tables(current, new, config, failed)
    est = estimate_scheme(tables, SWITCH_ALGO, topology=cost.cluster.topology(), failed=failed)
    return SwitchEstimate(est.total(), est.time)


def _too_few(
    config: ModelSpec, cost: CostModel, ranks: Sequence[int], dead: Sequence[int],
    min_replicas: int, dtype: str,
) -> str:  # fmt: skip
    """The alive count, the dead ranks and a lower bound on the ranks that would fit."""
    per_param = 18 if dtype == "bf16" else 16  # weights + fp32 grads + masters/Adam, no ZeRO
    states = per_param * stage_params(config, config.num_layers, 1, first=True, last=True)
    biggest = max(d.memory_bytes for d in cost.devices.values())
    room = biggest * (1 - PLAN_HEADROOM) - OVERHEAD_BYTES
    per_replica = max(1, math.ceil(states / room)) if room > 0 else math.inf
    gone = f" (dead or gone: R{format_ranks(dead)})" if dead else ""
    return (
        f"no elastic strategy for {len(ranks)} alive ranks{gone}: {min_replicas} data-parallel "
        f"replicas with ZeRO-1 off need at least {min_replicas} x {per_replica} ranks "
        f"(model states {states / 2**30:.0f} GiB a replica, at most "
        f"{max(room, 0) / 2**30:.0f} GiB a rank): add ranks or lower min_replicas"
    )
