"""Pipeline construction from the forward communication of a plan (paper, Appendix A.2).

Every rank starts as its own one-stage pipeline. Then, for each step of each resolved
forward reshard:

- a collective (all-reduce, all-gather, reduce-scatter, all-to-all) merges its group's
  ranks into one stage;
- a point-to-point transfer (send-recv, or a BSR transfer) from a rank that does not hold
  the result to a rank that did not hold the input appends the receiver's stage after the
  sender's; any other transfer stays inside a stage and merges the two ranks.

Pipelines are the connected chains of stages. Text form, one pipeline a line::

    pipeline 0: [0,1,2,3] -> [4,5,6,7]
    pipeline 1: [8,9] -> [10]

Split collectives (split-all-reduce ...) join pipelines, so they may only appear in Post
(gradient sync); one in the forward pass is an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hspmd.comm.plan import BatchedSendRecv, CommPlan, GroupCollective, SendRecv, SliceCollective
from hspmd.errors import StrategyError

__all__ = ["PipelineLayout", "check_pipelines", "construct_pipelines"]

Stage = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """Pipelines as ``pipelines[p][s]`` = the sorted ranks of stage ``s`` of pipeline ``p``.

    >>> layout = PipelineLayout((((0, 1), (2,)), ((3,),)))
    >>> layout.locate(2), print(layout)
    pipeline 0: [0,1] -> [2]
    pipeline 1: [3]
    ((0, 1), None)
    """

    pipelines: tuple[tuple[Stage, ...], ...]

    def locate(self, rank: int) -> tuple[int, int]:
        """``(pipeline, stage)`` of ``rank``."""
        for p, stages in enumerate(self.pipelines):
            for s, ranks in enumerate(stages):
                if rank in ranks:
                    return p, s
        raise StrategyError(f"rank {rank} is in no pipeline of {self.short()}")

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for stages in self.pipelines for st in stages for r in st))

    def short(self) -> str:
        return " ; ".join(" -> ".join(_ranks_text(s) for s in p) for p in self.pipelines)

    def __str__(self) -> str:
        return "\n".join(
            f"pipeline {p}: " + " -> ".join(_ranks_text(s) for s in stages)
            for p, stages in enumerate(self.pipelines)
        )

    def to_json(self) -> list[list[list[int]]]:
        return [[list(s) for s in stages] for stages in self.pipelines]


def _ranks_text(ranks: Sequence[int]) -> str:
    return "[" + ",".join(map(str, ranks)) + "]"


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _p2p_pairs(plan: CommPlan) -> Iterable[tuple[int, int]]:
    for step in plan.steps:
        if isinstance(step, SendRecv):
            yield from step.pairs
        elif isinstance(step, BatchedSendRecv):
            yield from ((t.src, t.dst) for t in step.transfers if t.src != t.dst)


def construct_pipelines(
    plans: Iterable[tuple[str, CommPlan]], *, ranks: Iterable[int] = ()
) -> PipelineLayout:
    """Pipelines from named forward plans; ``ranks`` adds ranks that no plan names."""
    named = list(plans)
    stages = _UnionFind()
    for rank in ranks:
        stages.find(rank)
    boundaries: list[tuple[str, int, int]] = []
    for name, plan in named:
        for rank in plan.ranks:
            stages.find(rank)
        for step in plan.steps:
            if isinstance(step, SliceCollective):
                raise StrategyError(
                    f"forward reshard {name!r} ({plan.src} -> {plan.dst}) resolves to "
                    f"{step.kind}, which joins pipelines: only gradient sync (Post) may"
                )
            if isinstance(step, GroupCollective):
                for group in step.groups:
                    for rank in group[1:]:
                        stages.union(group[0], rank)
        for src, dst in _p2p_pairs(plan):
            if src not in plan.dst and dst not in plan.src:
                boundaries.append((name, src, dst))
            else:
                stages.union(src, dst)
    return _chains(stages, boundaries)


def _chains(stages: _UnionFind, boundaries: list[tuple[str, int, int]]) -> PipelineLayout:
    members: dict[int, list[int]] = {}
    for rank in list(stages.parent):
        members.setdefault(stages.find(rank), []).append(rank)
    nexts: dict[int, set[int]] = {root: set() for root in members}
    prevs: dict[int, set[int]] = {root: set() for root in members}
    for _, src, dst in boundaries:
        a, b = stages.find(src), stages.find(dst)
        if a != b:
            nexts[a].add(b)
            prevs[b].add(a)
    for root in members:
        for label, links in (("followed", nexts[root]), ("preceded", prevs[root])):
            if len(links) > 1:
                others = ", ".join(_ranks_text(sorted(members[x])) for x in sorted(links))
                raise StrategyError(
                    f"stage {_ranks_text(sorted(members[root]))} is {label} by several stages "
                    f"({others}): pipelines must be chains; check the plan's stage boundaries"
                )
    pipelines = []
    for head in sorted(r for r in members if not prevs[r]):
        chain, node = [], head
        while True:
            chain.append(tuple(sorted(members[node])))
            if not nexts[node]:
                break
            node = next(iter(nexts[node]))
        pipelines.append(tuple(chain))
    if sum(len(p) for p in pipelines) != len(members):
        raise StrategyError("the stage boundaries form a cycle: a pipeline must start somewhere")
    return PipelineLayout(tuple(sorted(pipelines, key=lambda p: p[0][0])))


def check_pipelines(found: PipelineLayout, expected: Any) -> None:
    """Raise StrategyError unless ``found`` equals ``expected``.

    ``expected`` is a PipelineLayout, nested rank lists ``[[[0, 1], [2]], ...]``, or an
    object with ``.pipelines``, each with ``.stages``, each with ``.ranks`` (a Strategy).
    """
    want = _as_layout(expected)
    if found != want:
        raise StrategyError(
            "the pipelines found from the plan's communication differ from the strategy's:\n"
            f"  found:    {found.short()}\n  strategy: {want.short()}\n"
            "check that each stage's reshards join its ranks and that adjacent stages exchange "
            "activations at the layers.{i}.input markers"
        )


def _as_layout(expected: Any) -> PipelineLayout:
    if isinstance(expected, PipelineLayout):
        return expected
    pipes = getattr(expected, "pipelines", expected)
    out = []
    for pipe in pipes:
        stages = getattr(pipe, "stages", pipe)
        out.append(tuple(tuple(sorted(getattr(s, "ranks", s))) for s in stages))
    return PipelineLayout(tuple(sorted(out, key=lambda p: p[0][0])))
