"""Identical pipelines simulated once: a step predicted per class of pipelines.

Pipelines are disjoint sets of ranks, and up to the gradient sync the simulator couples
two of them only through a processor pool they share (CPU ranks of one host,
``CostModel.share_of``). Every other task of a pipeline (its stages' F and B, its sends
and their ports, its optimizer step) reads only what ``pipeline_key`` lists::

    per pipeline  micro-batches, their size, its ZeRO share
    per stage     layers, ranks (their kinds, in order), CP degree, recompute count,
                  the links of its TP group, of its CP group, to the previous and next stage

and the cross-pipeline sync reads every pipeline alike (a segment's ring, its holders).
Two pipelines with equal keys therefore run the same timeline, to the last bit, and so
``predict_by_class`` builds the tasks of the first pipeline of each class only, with the
gradient sync's collectives priced over their whole rings but waiting on those pipelines
alone (``hspmd.sim.restrict``): a dropped dep finishes when its class's first one does.
A pipeline with a pooled stage is a class of its own. The step time and every rank's
memory equal ``hspmd.planner.predict.predict``'s; the engine's ``result`` (spans, per-rank
totals) holds the first pipelines' ranks only.

At 65,536 ranks (llama-70b on H20, the last node gone: 8,191 one-stage pipelines, 2 or 3
micro-batches each) that is 2 classes, not 8,191 pipelines of tasks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence

from hspmd.cost.lines import CostModel, LinkCost
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import Strategy, StrategyOptions
from hspmd.planner.memory import RankMemory, stage_memory, stage_places
from hspmd.planner.predict import Prediction, step_tasks
from hspmd.sim.engine import simulate

__all__ = ["ClassMemory", "pipeline_classes", "pipeline_key", "predict_by_class"]


def _link(link: LinkCost) -> Hashable:
    """What a duration read of ``link``, hashable (``LinkCost`` holds dicts)."""
    return (link.name, tuple(link.fits.items()), link.per_flow, tuple(link.by_size.items()))


def pipeline_key(
    strategy: Strategy, p: int, cost: CostModel, options: StrategyOptions
) -> Hashable:  # fmt: skip
    """What pipeline ``p``'s tasks and memory read of it (module docstring); ``p`` itself
    where a stage computes in a shared processor pool."""
    pipe = strategy.pipelines[p]
    stages = []
    for s, stage in enumerate(pipe.stages):
        leader = stage.ranks[0]
        if cost.share_of(leader):
            return ("pooled", p)
        neighbours = tuple(
            _link(cost.link_between(leader, pipe.stages[n].ranks[0])) if 0 <= n < len(pipe.stages)
            else None
            for n in (s - 1, s + 1)
        )  # fmt: skip
        stages.append((
            stage.first_layer, stage.last_layer, stage.cp, stage.recompute,
            tuple(cost.kind_of(r) for r in stage.ranks),
            _link(cost.group_link(stage.ranks[:: stage.cp], stage.cp)),
            _link(cost.group_link(stage.ranks[: stage.cp], stage.tp)),
            neighbours,
        ))  # fmt: skip
    share = options.zero_shares[p] if options.zero_shares else None
    return (pipe.num_micro_batches, pipe.micro_batch_size, share, tuple(stages))


def pipeline_classes(
    strategy: Strategy, cost: CostModel, options: StrategyOptions
) -> list[tuple[int, ...]]:  # fmt: skip
    """The pipelines grouped by ``pipeline_key``, each class in pipeline order, the classes
    in the order of their first pipeline.

    >>> from hspmd.cost.cluster import load_cluster
    >>> from hspmd.plan.strategy import parse_strategy
    >>> cost = CostModel.of(load_cluster("h20x32"))
    >>> s = parse_strategy("2*(2x1: R0-7:L0-3); 3x1: R16-19:L0-3; 2x1: R24-31:L0-3")
    >>> pipeline_classes(s, cost, StrategyOptions())
    [(0, 1, 3), (2,)]
    """
    classes: dict[Hashable, list[int]] = {}
    for p in range(len(strategy.pipelines)):
        classes.setdefault(pipeline_key(strategy, p, cost, options), []).append(p)
    return [tuple(members) for members in classes.values()]


class ClassMemory(Mapping[int, RankMemory]):
    """Every rank's memory, held once per stage of a class's first pipeline: rank ``r``
    of a mirrored stage reads that stage's figures under its own id."""

    def __init__(self, stage_of: Mapping[int, RankMemory]) -> None:
        self._stage_of = stage_of  # rank -> its class stage's memory (a shared object)

    def __getitem__(self, rank: int) -> RankMemory:
        m = self._stage_of[rank]
        if m.rank == rank:
            return m
        return RankMemory(
            rank, m.weights, m.gradients, m.optimizer, m.activations, m.logits, m.overhead
        )  # fmt: skip

    def __iter__(self) -> Iterator[int]:
        return iter(self._stage_of)

    def __len__(self) -> int:
        return len(self._stage_of)


def predict_by_class(
    strategy: Strategy, config: ModelSpec, cost: CostModel, *, seq_len: int,
    options: StrategyOptions,
) -> Prediction:  # fmt: skip
    """``predict`` of ``strategy`` with one pipeline simulated per class (module docstring)."""
    classes = pipeline_classes(strategy, cost, options)
    firsts = [members[0] for members in classes]
    tasks, works = step_tasks(
        strategy, config, cost, seq_len=seq_len, options=options, pipelines=firsts
    )  # fmt: skip
    result = simulate(tasks, pools=cost.pools())
    memory = _class_memory(strategy, config, classes, seq_len=seq_len, options=options)
    over: dict[int, tuple[float, float]] = {}
    for rank, mem in memory.items():
        cap = cost.device_of(rank).memory_bytes
        if mem.peak > cap:
            over[rank] = (mem.peak, cap)
    every = {
        (p, s): works[(members[0], s)]
        for members in classes
        for p in members
        for s in range(len(strategy.pipelines[p].stages))
    }
    return Prediction(strategy, options, result.makespan, result, memory, over, every)


def _class_memory(
    strategy: Strategy, config: ModelSpec, classes: Sequence[tuple[int, ...]], *,
    seq_len: int, options: StrategyOptions,
) -> ClassMemory:  # fmt: skip
    """Every rank's memory, one ``stage_memory`` per stage of each class's first pipeline."""
    first_of = {p: members[0] for members in classes for p in members}
    places = stage_places(strategy, config.num_layers, options.schedule, shares=options.zero_shares)
    held: dict[tuple[int, int], RankMemory] = {}
    stage_of: dict[int, RankMemory] = {}
    for p, s, stage, place in places:
        key = (first_of[p], s)
        if key not in held:  # the class's first pipeline comes first: its stage, its place
            held[key] = stage_memory(config, stage, place, seq_len=seq_len, options=options)
        for rank in stage.ranks:
            stage_of[rank] = held[key]
    return ClassMemory(stage_of)
