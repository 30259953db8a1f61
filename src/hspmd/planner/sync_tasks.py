"""Post as simulator tasks: the runtime's own gradient-sync plans, priced, then Adam.

The plans are the ones the trainer builds and runs (``hspmd.specialize.sync_plans``):

=========  ===================================================  ==========================
ZeRO       reduce (after the last backward)                     gather (after Adam)
=========  ===================================================  ==========================
0          ``grad_sync_plan``: flat buckets of whole pieces     -
           and one plan per split parameter, ``hP -> hD``
           (all-reduce; split-all-reduce between TP degrees;
           a tied weight's first and last stage summed too)
1          ``zero1_plan``'s reduce of each parameter            one batch, compute dtype
           (split-reduce-scatter)
2          the same reduces in ``shard_buckets`` (4 MiB), each  as 1
           started as one batch
3          as 2, the buckets also cut where the layer changes   around each use (the stage's
                                                                work, ``predict.zero_gathers``)
=========  ===================================================  ==========================

Each plan is priced by ``hspmd.cost.comm_plans`` (fp32 gradients). Tasks group the plans by
*segment* (``segments``: a run of layers held by the same stage of every pipeline, cut into
``OVERLAP_PIECES`` where the sync overlaps backward) and by the ranks a plan spans: a
parameter belongs to the segment of its first layer (a bucket's gradients are final when
its first layer's are) and one task holds the plans of one (segment, ranks), their times
added (the runtime issues them one after another on its stream; a ZeRO-2/3 bucket is one
batch, ``PlanPricer.batch``), a segment's gathers as one batch (the runtime gathers all of a
rank's parameters in one: one task per set of ranks). So a step has a few sync tasks per stage whatever the rank count, and
identical plans (every layer's ``wq`` of one stage shares one object) are priced once.

A task starts after the holders' pieces of their last backward that finish its layers
(``overlap``, GPUs: the runtime issues startable plans from backward hooks) or after
their whole last backward. Context-parallel stages first sum their gradients over each CP
group (the stage's own sync, priced by the all-reduce line: its plans are deduced on the
captured graph, which the simulator does not build).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from hspmd.comm.plan import CommPlan, startable
from hspmd.cost.comm_plans import PlanPricer
from hspmd.cost.lines import CostModel
from hspmd.cost.stage import embed_params, head_params, layer_params, stage_params
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import Pipeline, Strategy, StrategyOptions
from hspmd.planner.memory import layer_holders
from hspmd.planner.shard_parts import shard_parts
from hspmd.sim.engine import Task
from hspmd.specialize.sync_plans import (
    BUCKET_BYTES,
    ZeroItem,
    grad_sync_plan,
    shard_buckets,
    zero1_plan,
)

__all__ = [
    "OVERLAP_PIECES", "PostPlans", "Segment", "busy_cores", "last_b_pieces", "post_plans",
    "segments", "sync_tasks",
]  # fmt: skip

GRAD_BYTES = 4  # gradients are synced in fp32 (the masters' dtype)

# The runtime issues the gradient sync item by item as the last backward finishes them
# (hspmd.train.overlap); the simulator cuts each segment into this many runs of layers, so
# that the sync of the last layers runs beside the backward of the first.
OVERLAP_PIECES = 4


@dataclass(frozen=True, slots=True)
class Segment:
    """Layers ``first..last`` held by the same stage of every pipeline (``holders``: one
    ``(pipeline, stage)`` per pipeline, in pipeline order), with ``params`` parameters
    including the embedding or head where the segment holds them."""

    first: int
    last: int
    holders: tuple[tuple[int, int], ...]
    params: int


def segments(strategy: Strategy, config: ModelSpec, *, pieces: int = 1) -> list[Segment]:
    """The gradient-sync segments of ``strategy`` in layer order, each cut into up to
    ``pieces`` runs of layers."""
    cuts = {0, config.num_layers}
    for _, _, stage in strategy.stages():
        cuts |= {stage.first_layer, stage.last_layer + 1}
    bounds = sorted(cuts)
    if pieces > 1:
        for a, b in zip(bounds, bounds[1:], strict=False):
            n = min(pieces, b - a)
            cuts |= {a + (b - a) * k // n for k in range(1, n)}
        bounds = sorted(cuts)
    out = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        holders = []
        for p, pipeline in enumerate(strategy.pipelines):
            s = next(
                i for i, st in enumerate(pipeline.stages) if st.first_layer <= a <= st.last_layer
            )
            holders.append((p, s))
        params = (b - a) * layer_params(config)
        params += embed_params(config) if a == 0 else 0
        params += head_params(config) if b == config.num_layers else 0
        out.append(Segment(a, b - 1, tuple(holders), params))
    return out


def last_b_pieces(p: int, s: int, pipe: Pipeline, segs: Sequence[Segment]) -> list[tuple[str, int]]:
    """The last backward of stage ``s`` of pipeline ``p`` cut at its segments, in the
    order backward runs them (last layers first): (task id, layers) per piece."""
    # holders[p] is pipeline p's (segments): one lookup, not a scan of every pipeline's
    mine = sorted((g for g in segs if g.holders[p] == (p, s)), key=lambda g: -g.first)
    return [(piece_of(p, s, pipe, g), g.last - g.first + 1) for g in mine]


def piece_of(p: int, s: int, pipe: Pipeline, seg: Segment) -> str:
    """The id of the piece of stage ``(p, s)``'s last backward that finishes ``seg``'s
    layers (``last_b_pieces``: the piece of the stage's first layers is the whole task's)."""
    tid = last_b_id(p, s, pipe)
    return tid if seg.first == pipe.stages[s].first_layer else f"{tid}@L{seg.first}"


def last_b_id(p: int, s: int, pipe: Pipeline) -> str:
    """Both schedules end every stage with the last micro-batch's backward."""
    return f"p{p}s{s}B{pipe.num_micro_batches - 1}"


def busy_cores(cost: CostModel, ranks: Sequence[int]) -> float | None:
    """The cores a stage's compute keeps busy in its host's pool: one per rank, unless its
    kind is slowed (``slowdown`` F: an emulated slow device computes 1/F of the time and
    sleeps the rest, ``hspmd train --slowdown``); None for the default, one per rank."""
    factor = cost.device_of(ranks[0]).slowdown
    return len(ranks) / factor if factor > 1 else None


Issued = tuple[tuple[tuple[str, ...], tuple[CommPlan, ...]], ...]  # (names, plans), in order


@dataclass(frozen=True, slots=True)
class PostPlans:
    """Post's plans of a strategy (module docstring), as the runtime issues them: each entry
    of ``reduces`` one ``start_plan`` (one plan) or, ``batched``, one bucket's
    ``start_plans``; ``gathers`` after Adam, one plan each (a segment's priced as one
    batch), of ``gather_bytes`` an element."""

    reduces: Issued
    gathers: Issued
    batched: bool
    gather_bytes: int


def post_plans(
    strategy: Strategy, config: ModelSpec, options: StrategyOptions, *, element_bytes: int,
    bucket_bytes: int = BUCKET_BYTES,
) -> PostPlans:  # fmt: skip
    """The plans Post runs under ``options``, built by the trainer's own functions."""
    if not (options.zero1 and len(strategy.pipelines) > 1):
        sync = grad_sync_plan(strategy, config, bucket_bytes=bucket_bytes)
        return PostPlans(tuple((i.names, (i.plan,)) for i in sync), (), False, element_bytes)
    items = _zero_items(strategy, config, options.zero_shares)
    gathers: Issued = ()
    if options.zero < 3:
        gathers = tuple(((n,), (i.gather,)) for n, i in items.items())
    reduces: Issued
    if options.zero == 1:  # each gradient's reduce issued alone (``ZeroOne``)
        reduces = tuple(((n,), (items[n].reduce,)) for n in reversed(items))
        return PostPlans(reduces, gathers, batched=False, gather_bytes=element_bytes)
    layer_of = config.param_layer if options.zero == 3 else None
    buckets = shard_buckets(items, bucket_bytes=bucket_bytes, layer_of=layer_of)
    reduces = tuple((b.names, b.plans) for b in buckets)
    return PostPlans(reduces, gathers, batched=True, gather_bytes=element_bytes)


def _zero_items(
    strategy: Strategy, config: ModelSpec, shares: tuple[float, ...]
) -> dict[str, ZeroItem]:
    """``zero1_plan``, kept for the last few layouts: the plans depend on the stages, not on
    the micro-batches, and a planner search predicts the same pipelines with other
    micro-batch counts and under each ZeRO stage (at 4096 ranks, 8 predictions of 4
    layouts; at 65,536 ranks a build takes seconds). A model spec that cannot be hashed
    is built each time."""
    try:
        hash(config)
    except TypeError:
        return zero1_plan(strategy, config, shares=shares)
    stages_only = Strategy(
        tuple(dataclasses.replace(p, num_micro_batches=1, micro_batch_size=1)
              for p in strategy.pipelines)
    )  # fmt: skip
    return _zero_items_of_layout(stages_only, config, shares)


@functools.lru_cache(maxsize=4)
def _zero_items_of_layout(
    strategy: Strategy, config: ModelSpec, shares: tuple[float, ...]
) -> dict[str, ZeroItem]:
    return zero1_plan(strategy, config, shares=shares)


@dataclass(frozen=True, slots=True)
class _Group:
    """Issued entries of one segment over the same ranks: one simulator task."""

    seg: Segment
    ranks: tuple[int, ...]
    holders: tuple[tuple[int, int], ...]  # the (pipeline, stage)s whose ranks it spans
    entries: tuple[tuple[CommPlan, ...], ...]


def _groups(strategy: Strategy, config: ModelSpec, issued: Issued, segs: Sequence[Segment]) -> list[_Group]:  # fmt: skip
    """``issued`` grouped by (segment of the first layer, ranks), the latest segment first
    (the order backward finishes them), each group's entries in issue order."""
    seg_of = [0] * config.num_layers
    for index, seg in enumerate(segs):
        for layer in range(seg.first, seg.last + 1):
            seg_of[layer] = index
    layers_of = getattr(config, "param_layers", None)
    where = {r: (p, s) for p, s, stage in strategy.stages() for r in stage.ranks}
    ranks_of: dict[tuple[int, ...], tuple[int, ...]] = {}
    found: dict[tuple[int, tuple[int, ...]], list[tuple[CommPlan, ...]]] = {}
    for names, plans in issued:
        first = min(min(layers_of(n)) if layers_of else config.param_layer(n) for n in names)
        ids = tuple(id(plan) for plan in plans)
        if ids not in ranks_of:
            ranks_of[ids] = tuple(sorted({r for plan in plans for r in plan.ranks}))
        found.setdefault((seg_of[first], ranks_of[ids]), []).append(plans)
    order = sorted(found, key=lambda key: -key[0])  # stable: issue order inside a segment
    return [
        _Group(segs[index], ranks, tuple(sorted({where[r] for r in ranks})), tuple(found[(index, ranks)]))
        for index, ranks in order
    ]  # fmt: skip


def _ids(groups: Sequence[_Group], kind: str) -> list[str]:
    """``sync3-5`` per segment; a second group of one segment (a tied weight's) ``sync3-5/1``."""
    seen: dict[int, int] = {}
    out = []
    for g in groups:
        k = seen[g.seg.first] = seen.get(g.seg.first, -1) + 1
        out.append(f"{kind}{g.seg.first}-{g.seg.last}" + (f"/{k}" if k else ""))
    return out


def sync_tasks(
    strategy: Strategy, config: ModelSpec, cost: CostModel, options: StrategyOptions, *,
    plans: PostPlans, segs: Sequence[Segment], overlap: bool,
) -> list[Task]:  # fmt: skip
    """The CP gradient sums, the gradient sync of ``plans`` (``post_plans``), each rank's
    Adam and ZeRO's gathers."""
    pricer = PlanPricer.of(cost)
    tasks, synced = _cp_tasks(strategy, config, cost)
    reduce_groups = _groups(strategy, config, plans.reduces, segs)
    for group, tid in zip(reduce_groups, _ids(reduce_groups, "sync"), strict=True):
        seconds = sum(
            pricer.batch(entry, element_bytes=GRAD_BYTES)
            if plans.batched
            else pricer.plan(entry[0], element_bytes=GRAD_BYTES)
            for entry in group.entries
        )
        early = overlap and all(startable(plan) for entry in group.entries for plan in entry)
        tasks.append(Task(tid, group.ranks[0], "comm", seconds, category="comm",
                          deps=_reduce_deps(strategy, group, early=early),
                          ranks=group.ranks if len(group.ranks) > 1 else (),
                          label=f"sync L{group.seg.first}-{group.seg.last}"))  # fmt: skip
        for r in group.ranks:
            synced.setdefault(r, []).append(tid)
    tasks += _adam_tasks(strategy, config, cost, options, synced)
    # a rank gathers all its parameters in one batch after its Adam: one segment for all
    whole = [Segment(0, config.num_layers - 1, (), 0)] if plans.gathers else []
    gather_groups = _groups(strategy, config, plans.gathers, whole)
    for group, tid in zip(gather_groups, _ids(gather_groups, "gather"), strict=True):
        every = [plan for entry in group.entries for plan in entry]
        seconds = pricer.batch(every, element_bytes=plans.gather_bytes)
        tasks.append(Task(tid, group.ranks[0], "comm", seconds, category="comm",
                          deps=tuple(f"adam p{p}s{s}" for p, s in group.holders),
                          ranks=group.ranks if len(group.ranks) > 1 else (),
                          label=f"gather L{group.seg.first}-{group.seg.last}"))  # fmt: skip
    return tasks


def _reduce_deps(strategy: Strategy, group: _Group, *, early: bool) -> tuple[str, ...]:
    """Each holder's piece of its last backward that finishes the group's layers (``early``:
    issued from backward hooks), else its whole last backward (a tied weight's other stage
    holds none of the segment's layers: its whole last backward)."""
    deps = []
    for p, s in group.holders:
        pipe = strategy.pipelines[p]
        stage = pipe.stages[s]
        inside = stage.first_layer <= group.seg.first <= stage.last_layer
        deps.append(piece_of(p, s, pipe, group.seg) if early and inside else last_b_id(p, s, pipe))
    return tuple(deps)


def _cp_tasks(
    strategy: Strategy, config: ModelSpec, cost: CostModel
) -> tuple[list[Task], dict[int, list[str]]]:
    """Context parallel: each stage's gradients summed over its CP groups (module docstring)."""
    tasks: list[Task] = []
    synced: dict[int, list[str]] = {}
    for p, s, stage in strategy.stages():
        if stage.cp == 1:
            continue
        pipe = strategy.pipelines[p]
        n = stage_params(config, len(stage.layers), stage.tp, first=s == 0,
                         last=s == len(pipe.stages) - 1)  # fmt: skip
        seconds = cost.collective("all-reduce", n * GRAD_BYTES, stage.cp_groups[0], stage.tp)
        tid = f"cpsync p{p}s{s}"
        tasks.append(Task(tid, stage.ranks[0], "comm", seconds, category="comm",
                          deps=(last_b_id(p, s, pipe),), ranks=stage.ranks, label="CP grad sync"))  # fmt: skip
        for r in stage.ranks:
            synced.setdefault(r, []).append(tid)
    return tasks, synced


def _adam_tasks(
    strategy: Strategy, config: ModelSpec, cost: CostModel, options: StrategyOptions,
    synced: dict[int, list[str]],
) -> list[Task]:  # fmt: skip
    """Each stage's Adam on what its ranks hold: the whole parameters, or under ZeRO the
    shard (``1 / replicas``, or the pipeline's part of uneven shares)."""
    zero = options.zero1 and len(strategy.pipelines) > 1
    parts = shard_parts(options.zero_shares) if zero and options.zero_shares else ()
    holders = layer_holders(strategy, config.num_layers)
    tasks = []
    for p, s, stage in strategy.stages():
        pipe = strategy.pipelines[p]
        n = stage_params(
            config, len(stage.layers), stage.tp, first=s == 0, last=s == len(pipe.stages) - 1
        )
        part = 1 / min(holders[x] for x in stage.layers) if zero else 1.0
        part = parts[p] if parts else part  # the part of the shard this replica holds
        seconds = cost.device_of(stage.ranks[0]).seconds("optimizer", 4 * n * part)
        deps = tuple(synced.get(stage.ranks[0], [])) or (last_b_id(p, s, pipe),)
        tasks.append(Task(f"adam p{p}s{s}", stage.ranks[0], "compute", seconds, category="optimizer",
                          deps=deps, ranks=stage.ranks if len(stage.ranks) > 1 else (), label="Adam",
                          share=cost.share_of(stage.ranks[0]), weight=busy_cores(cost, stage.ranks)))  # fmt: skip
    return tasks
