"""Post's plans as pure metadata: the gradient sync across pipelines and ZeRO's reduces and gathers.

The trainer runs these (``hspmd.train.post``, ``hspmd.train.zero``, ``hspmd.train.overlap``)
and the simulator prices them (``hspmd.planner.sync_tasks``), so the two cannot drift
(DESIGN decision 12). Nothing here imports torch.

Gradient synchronization as resolved plans, one per bucket of parameters.

A parameter's gradient carries its annotation with the top tier partial (``hP``): each
pipeline holds a summand. Synchronizing is the reshard ``hP -> hD``, which resolution turns
into an all-reduce across pipelines (same TP degree) or a split-all-reduce (different TP
degrees: paper section 5.2). Parameters whose pieces are whole on every rank (duplicate
inside every stage: TP degree 1, or norm weights) and that share an annotation are
flattened into buckets of at most ``bucket_bytes`` (as DDP does; a parameter larger than
that is a bucket alone), filled from the last parameter back. Items come in reverse model
order (by their last parameter), the order in which backward finishes their gradients, so
that ``hspmd.train.overlap`` can issue each as soon as its gradients are final::

    >>> from hspmd.models.llama import get_config
    >>> from hspmd.plan.strategy import parse_strategy
    >>> items = grad_sync_plan(parse_strategy("2x1: R0:L0-3; 2x1: R1:L0-3"), get_config("llama-tiny"))
    >>> [(len(i.names), i.plan.kinds) for i in items]
    [(39, ('all-reduce',))]
    >>> small = grad_sync_plan(parse_strategy("2x1: R0:L0-3; 2x1: R1:L0-3"),
    ...                        get_config("llama-tiny"), bucket_bytes=1 << 18)
    >>> [len(i.names) for i in small], small[0].names[-1]
    ([12, 15, 12], 'head.weight')
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hspmd.annotation import DUP, PARTIAL, Annotation
from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import ParamSpec, parameter_annotations, state_annotations
from hspmd.plan.strategy import Strategy

__all__ = [
    "BUCKET_BYTES", "ShardBucket", "SyncItem", "ZeroItem", "grad_sync_plan", "shard_buckets",
    "zero1_plan",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class SyncItem:
    """Parameters synchronized by one plan; ``flat``: their gradients travel concatenated."""

    names: tuple[str, ...]
    plan: CommPlan
    flat: bool

    def __str__(self) -> str:
        what = f"{len(self.names)} params" if self.flat else self.names[0]
        return f"{what}: {' + '.join(self.plan.kinds) or 'nothing'} {self.plan.dst}"


def _whole(annotation: Annotation) -> bool:
    return all(all(d == DUP for d, _ in ds.entries) for ds in annotation.states)


BUCKET_BYTES = 4 << 20  # fp32 gradient bytes per flat bucket (DDP: 25 MiB, first 1 MiB)


def grad_sync_plan(
    strategy: Strategy, config: ModelSpec, *, bucket_bytes: int = BUCKET_BYTES
) -> tuple[SyncItem, ...]:
    """Every plan Post runs, in one order shared by all ranks (pure metadata)."""
    specs = parameter_annotations(strategy, config)
    position = {name: i for i, name in enumerate(specs)}
    buckets: dict[Annotation, list[ParamSpec]] = {}
    split: dict[tuple[int, tuple[int, ...]], CommPlan] = {}
    items = []
    for spec in specs.values():
        if spec.annotation.hsize == 1:
            continue  # one pipeline: every gradient is already whole where it lives
        if _whole(spec.annotation):
            buckets.setdefault(spec.annotation, []).append(spec)
            continue
        key = (id(spec.annotation), spec.shape)
        if key not in split:  # every layer of a stage: one resolution
            split[key] = resolve(_partial(spec.annotation), spec.annotation, spec.shape)
        items.append(SyncItem((spec.name,), split[key], False))
    for annotation, members in buckets.items():
        grad = _partial(annotation)
        for chunk in _chunks(members, bucket_bytes):
            plan = resolve(grad, annotation, (sum(math.prod(s.shape) for s in chunk),))
            items.append(SyncItem(tuple(s.name for s in chunk), plan, True))
    return tuple(sorted(items, key=lambda item: -max(position[n] for n in item.names)))


@functools.lru_cache(maxsize=256)
def _partial(annotation: Annotation) -> Annotation:
    """The gradient's annotation of a parameter: its top tier partial (each pipeline holds a
    summand). Cached: every layer of a stage shares its parameters' annotations."""
    return dataclasses.replace(annotation, hdim=PARTIAL, hsizes=None)


def _chunks(members: list[ParamSpec], bucket_bytes: int) -> list[list[ParamSpec]]:
    """``members`` cut into runs of at most ``bucket_bytes`` (fp32), from the last one back;
    each run keeps model order."""
    out: list[list[ParamSpec]] = []
    run: list[ParamSpec] = []
    size = 0
    for spec in reversed(members):
        nbytes = 4 * math.prod(spec.shape)
        if run and size + nbytes > bucket_bytes:
            out.append(run[::-1])
            run, size = [], 0
        run.append(spec)
        size += nbytes
    if run:
        out.append(run[::-1])
    return out


@dataclass(frozen=True, slots=True)
class ZeroItem:
    """One parameter's Post under ZeRO-1: its gradient's reduce and its parameter's gather."""

    name: str
    shape: tuple[int, ...]
    reduce: CommPlan  # grad (hP) -> state shard
    gather: CommPlan  # state shard -> param (hD)


def zero1_plan(
    strategy: Strategy, config: ModelSpec, *, shares: tuple[float, ...] = ()
) -> dict[str, ZeroItem]:
    """Every parameter's reduce and gather plans under ZeRO-1, 2 and 3, in model order (pure
    metadata; ``hspmd.train.zero``); ``shares``: the pipelines' weights of uneven shards
    (``--zero-shares``).

    >>> from hspmd.models.llama import get_config
    >>> from hspmd.plan.strategy import parse_strategy
    >>> items = zero1_plan(parse_strategy("1x1: R0-1:L0-3; 1x1: R2:L0-3"), get_config("llama-tiny"))
    >>> item = items["layers.0.attn.wq.weight"]
    >>> item.reduce.kinds, item.gather.kinds
    (('split-reduce-scatter',), ('split-all-gather',))
    """
    params = parameter_annotations(strategy, config)
    states = state_annotations(strategy, config, zero1=True, shares=shares, params=params)
    items = {}
    # one resolution per (annotations, shape): every layer of a stage has the same plans
    # (resolve's own cache would compare the annotations, rank by rank, on every hit)
    plans: dict[tuple[int, int, tuple[int, ...]], tuple[CommPlan, CommPlan]] = {}
    for name, spec in params.items():
        param, state = spec.annotation, states[name].annotation
        key = (id(param), id(state), spec.shape)
        if key not in plans:
            grad = _partial(param) if param.hsize > 1 else param
            plans[key] = (resolve(grad, state, spec.shape), resolve(state, param, spec.shape))
        items[name] = ZeroItem(name, spec.shape, *plans[key])
    return items


@dataclass(frozen=True, slots=True)
class ShardBucket:
    """Parameters whose gradients are reduced to their shards in one batch."""

    names: tuple[str, ...]
    plans: tuple[CommPlan, ...]  # each gradient (hP) -> its state shard

    def __str__(self) -> str:
        return f"{len(self.names)} params: {' + '.join(sorted({k for p in self.plans for k in p.kinds}))}"


def shard_buckets(
    items: Mapping[str, ZeroItem], *, bucket_bytes: int,
    layer_of: Callable[[str], int] | None = None,
) -> tuple[ShardBucket, ...]:  # fmt: skip
    """Every rank's buckets (module docstring), in the order they are issued; with
    ``layer_of`` (ZeRO-3) also cut where the layer changes, so that a bucket's full
    gradients are one layer's at most, as its gathered parameters are.

    >>> from hspmd.models.llama import get_config
    >>> from hspmd.plan.strategy import parse_strategy
    >>> items = zero1_plan(parse_strategy("1x1: R0:L0-3; 1x1: R1:L0-3"), get_config("llama-tiny"))
    >>> [len(b.names) for b in shard_buckets(items, bucket_bytes=1 << 17)]
    [3, 8, 6, 7, 7, 7, 1]
    >>> [len(b.names) for b in shard_buckets(items, bucket_bytes=1 << 30,
    ...                                      layer_of=get_config("llama-tiny").param_layer)]
    [11, 9, 9, 10]
    """
    out: list[ShardBucket] = []
    run: list[ZeroItem] = []
    size = 0
    for item in reversed(list(items.values())):
        nbytes = 4 * math.prod(item.shape)
        other = layer_of is not None and bool(run) and layer_of(run[-1].name) != layer_of(item.name)
        if run and (size + nbytes > bucket_bytes or other):
            out.append(ShardBucket(tuple(i.name for i in run), tuple(i.reduce for i in run)))
            run, size = [], 0
        run.append(item)
        size += nbytes
    if run:
        out.append(ShardBucket(tuple(i.name for i in run), tuple(i.reduce for i in run)))
    return tuple(out)
