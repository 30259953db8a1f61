"""The switch after a failure: states move from the surviving replicas onto the new plan.

The source is the strategy that ran when ranks died, in the *old* generation's rank
numbers; the target is the re-planned strategy in the *new* generation's numbers (the
survivors renumbered 0..n-1, ``renumber``). A source annotation keeps only what survives:
a subgroup that lost a rank is dropped whole (its shards are incomplete), except a pure
duplicate subgroup, which keeps its living ranks. Then one fused BSR moves masters and
both Adam moments from those holders (``hspmd.switch.live``'s plan, the same owner
choice)::

    old  hD: [0,1]{0:2} [2,3]{0:2}     rank 1 dies, survivors 0 2 3 -> new 0 1 2
    kept [2,3]{0:2}  ->  renumbered [1,2]{0:2}  ->  to the target's annotation

>>> from hspmd.annotation import parse_annotation as A
>>> str(surviving(A("hD: [0,1]{0:2} [2,3]{0:2}"), {1}))
'[2,3]{0:2}'
>>> str(surviving(A("hD: [0,1]{D:2} [2]{}"), {1, 2}))
'[0]{}'
>>> surviving(A("[0,1]{0:2}"), {0}) is None
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from hspmd.annotation import DUP, Annotation, DeviceGroup, DistributedStates
from hspmd.comm.topology import Topology
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import parameter_annotations, state_annotations
from hspmd.plan.strategy import Pipeline, Strategy
from hspmd.runtime.fused import FusedTensor
from hspmd.switch.live import STATE_KINDS, SwitchPlan, fused_scheme

__all__ = ["lost_states", "plan_survivor_switch", "renumber", "renumber_strategy", "surviving"]


def surviving(annotation: Annotation, dead: Collection[int]) -> Annotation | None:
    """What of ``annotation`` survives the ``dead`` ranks (module docstring); None: nothing
    whole is left. Only duplicate unions (``hD``) or single subgroups qualify."""
    if not dead_in(annotation, dead):
        return annotation
    if annotation.hsize > 1 and annotation.hdim != DUP:
        return None  # split or partial across subgroups: every subgroup is needed
    groups, states = [], []
    for group, ds in zip(annotation.groups, annotation.states, strict=True):
        alive = tuple(r for r in group.ranks if r not in dead)
        if len(alive) == len(group.ranks):
            groups.append(group)
            states.append(ds)
        elif alive and all(d == DUP for d, _ in ds.entries):  # a whole copy on each
            groups.append(DeviceGroup(alive))
            states.append(DistributedStates.of((DUP, len(alive))))
    if not groups:
        return None
    return Annotation(tuple(groups), tuple(states), annotation.hdim)


def dead_in(annotation: Annotation, dead: Collection[int]) -> bool:
    return any(r in dead for r in annotation.ranks)


def renumber(annotation: Annotation, mapping: Mapping[int, int]) -> Annotation:
    """The same annotation with every rank ``r`` replaced by ``mapping[r]``."""
    groups = tuple(DeviceGroup(tuple(mapping[r] for r in g.ranks)) for g in annotation.groups)
    return Annotation(groups, annotation.states, annotation.hdim, annotation.hsizes)


def renumber_strategy(strategy: Strategy, mapping: Mapping[int, int]) -> Strategy:
    """``strategy`` with every rank ``r`` replaced by ``mapping[r]``.

    >>> from hspmd.plan.strategy import parse_strategy
    >>> str(renumber_strategy(parse_strategy("1x2: R1:L0-3; 1x2: R3:L0-3"), {1: 0, 3: 1}))
    '1x2: R0:L0-3; 1x2: R1:L0-3'
    """
    return Strategy(
        tuple(
            Pipeline(
                p.num_micro_batches,
                p.micro_batch_size,
                tuple(
                    dataclasses.replace(s, ranks=tuple(mapping[r] for r in s.ranks))
                    for s in p.stages
                ),
            )
            for p in strategy.pipelines
        )
    )


def lost_states(config: ModelSpec, source: Strategy, dead: Collection[int]) -> list[str]:
    """Parameters of ``source`` whose every holder died (their states are gone)."""
    states = state_annotations(source, config, zero1=False)
    return [name for name, spec in states.items() if surviving(spec.annotation, dead) is None]


def plan_survivor_switch(
    config: ModelSpec, source: Strategy, target: Strategy, *, renumbered: Mapping[int, int],
    topology: Topology | None = None,
) -> SwitchPlan:  # fmt: skip
    """The fused BSR from the survivors of ``source`` (old numbers; ``renumbered`` maps
    each surviving old rank to its new one, the others are dead) to ``target`` (new
    numbers). ZeRO-1 is off in elastic runs: states have the parameters' annotations."""
    dead = set(source.ranks) - set(renumbered)
    src_states = state_annotations(source, config, zero1=False)
    dst_states = state_annotations(target, config, zero1=False)
    dst_params = parameter_annotations(target, config)
    names: list[str] = []
    tensors: list[FusedTensor] = []
    for name, spec in src_states.items():
        kept = surviving(spec.annotation, dead)
        if kept is None:
            raise ValueError(f"{name}: every holder died; load a checkpoint instead")
        src = renumber(kept, renumbered)
        dst = dst_states[name].annotation
        assert dst_params[name].annotation == dst, "ZeRO-1 is off: states are parameters"
        for kind in STATE_KINDS:
            names.append(f"{kind}/{name}")
            tensors.append(FusedTensor(spec.shape, src, dst))
    _, transfers = fused_scheme(tensors, topology or Topology.flat())
    return SwitchPlan(tuple(names), tuple(tensors), transfers)
