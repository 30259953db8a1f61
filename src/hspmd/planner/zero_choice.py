"""The planner's ZeRO choice: per plan, the stage that shards enough and the shards' split.

What each stage costs in the simulator (``hspmd.planner.predict``) and saves in the memory
model (``hspmd.planner.memory``), per parameter, over ``z`` replicas::

    stage  step time                                          saves per rank
    0      the gradients' all-reduce                          -
    1      reduce-scatter + all-gather instead (bf16: 6 bytes masters + Adam, 12 (1 - 1/z)
           on the ring, not 8), Adam on 1/z
    2      as 1                                               + gradients, 4 (1 - 1/z)
    3      as 2 less Post's all-gather, plus a gather of      + the weights between uses
           every layer in every forward and backward

So stage 1 is never slower than 0 where there are replicas, 2 costs what 1 costs, and 3
costs gathers (by the bytes: the simulator prices the runtime's plans, whose reduce-scatter
is point to point, a message per replica pair; over many replicas their latencies can make
1 dearer than 0, and 2, whose reduces go in buckets, cheaper than 1: docs/decisions.md): more sharding pays only where memory binds, by what it lets the plan drop
(recompute) or hold at all. Per candidate strategy the planner therefore simulates the
stages in the order of what they cost (``zero_predictions``, ``variants``), each with
recompute trimmed to what that stage's memory needs (``hspmd.planner.trim``), and stops
at the first that fits with nothing recomputed; the fastest fitting prediction of all wins
(ties: the one found first). Where the replicas of a layer sit on devices with unequal
room for their shards, the highest stage below 3, and 3, are also tried with
memory-proportional shares (``memory_shares``): they cost time (the replica holding the
most sets each exchange's pace, ``hspmd.planner.shard_parts``) and save it where an even
split leaves one pipeline recomputing or over its memory.

Memory-proportional shares. A rank ``r`` of pipeline ``p`` needs ``U_r`` bytes whatever
its share (activations, logits, compute weights, overhead; the planner takes the
activations of every layer recomputed, the least a rank can keep, and trims recompute
after the split) and ``S_r`` per whole shard
(``rank_memory`` is linear in the share). Pipeline ``p`` can hold at most
``f_p = min_r (cap_r - U_r) / S_r`` of every shard; weights ``f_p`` give each the part
``f_p / sum f``, which fits every rank whenever any split does (``sum f >= 1``) and leaves
every pipeline the same fraction of its room.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hspmd.cost.lines import CostModel
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import Strategy, StrategyOptions
from hspmd.planner.closed_form import PLAN_HEADROOM, within_headroom
from hspmd.planner.memory import stage_memory, stage_places, strategy_memory
from hspmd.planner.pipeline_classes import predict_by_class
from hspmd.planner.predict import Prediction
from hspmd.planner.trim import trim_recompute

__all__ = [
    "EVEN_WITHIN", "memory_shares", "most_saved", "variants", "zero_predictions", "zero_stages",
]  # fmt: skip

EVEN_WITHIN = 0.02  # rooms this close (relative) give even shares


def zero_stages(zero1: str, zero: int | None, replicas: int) -> tuple[int, ...]:
    """The stages the planner tries for a plan of ``replicas`` pipelines: ``zero`` alone
    where given; else none with ``zero1 == "off"`` or one pipeline, 1 with ``"on"``, and
    1, 2, 3 with ``"auto"`` (stage 0 is never faster where there are replicas).

    >>> zero_stages("auto", None, 2), zero_stages("auto", None, 1), zero_stages("on", None, 4)
    ((1, 2, 3), (0,), (1,))
    """
    if zero is not None:
        return (zero,)
    if zero1 == "off" or (zero1 == "auto" and replicas < 2):
        return (0,)
    return (1,) if zero1 == "on" else (1, 2, 3)


def memory_shares(
    strategy: Strategy, config: ModelSpec, cost: CostModel, *, seq_len: int,
    options: StrategyOptions,
) -> tuple[float, ...]:  # fmt: skip
    """One weight per pipeline in proportion to the part of every shard its memory can
    hold (module docstring), rounded to 3 digits; ``()`` where they are even (within
    ``EVEN_WITHIN``), without ZeRO, or for one pipeline."""
    d = len(strategy.pipelines)
    if not options.zero or d < 2:
        return ()
    room = [math.inf] * d
    even = replace(options, zero_shares=())
    for p, _, stage, place in stage_places(strategy, config.num_layers, options.schedule):
        cap = min(cost.device_of(r).memory_bytes for r in stage.ranks) * (1 - PLAN_HEADROOM)
        none, whole = (
            stage_memory(config, stage, replace(place, share=share), seq_len=seq_len,
                         options=even).peak
            for share in (0.0, 1.0)
        )  # fmt: skip
        if whole > none:
            room[p] = min(room[p], (cap - none) / (whole - none))
    finite = [f for f in room if math.isfinite(f)]
    if len(finite) < d or max(finite) <= 0:
        return ()
    floor = max(finite) * 1e-3  # a pipeline without room still holds a sliver
    weights = [max(f, floor) for f in finite]
    if max(weights) - min(weights) <= EVEN_WITHIN * max(weights):
        return ()
    least = min(weights)
    return tuple(round(w / least, 3) for w in weights)


def zero_predictions(
    strategy: Strategy, config: ModelSpec, cost: CostModel, *, seq_len: int,
    options: StrategyOptions, stages: tuple[int, ...], uneven: bool = True,
    bound: float = math.inf,
) -> list[Prediction]:  # fmt: skip
    """``strategy`` simulated under each stage of ``stages``, even and (``uneven``, where
    the replicas' rooms differ) with memory-proportional shares, in ``variants``' order,
    recompute trimmed to what each needs; it stops at the first that fits recomputing
    nothing (module docstring). After the first, a variant is simulated only if its memory
    fits and some stage recomputes fewer layers than under every fitting one simulated
    (else it is no faster: the variants come in the order of what they cost). None is
    tried where even dropping all of the first one's recompute could not bring it under
    ``bound`` (the fastest fitting step found so far; ``most_saved``)."""
    out: list[Prediction] = []
    simulated: list[tuple[int, ...]] = []  # per stage, the layers recomputed by a fitting one
    for zero, proportional in variants(stages, uneven=uneven):
        base = replace(options, zero=zero, zero_shares=(), recompute=True, recompute_layers=0)
        if proportional:  # the rooms left at the least activations (all recomputed)
            shares = memory_shares(strategy, config, cost, seq_len=seq_len, options=base)
            if not shares:
                continue
            base = replace(base, zero_shares=shares)
        trimmed, opts = trim_recompute(strategy, config, cost, seq_len=seq_len, options=base)
        counts = tuple(k for ks in trimmed.recomputed(opts) for k in ks)
        if out and (
            any(all(a >= b for a, b in zip(counts, c, strict=True)) for c in simulated)
            or not _fits(trimmed, config, cost, seq_len=seq_len, options=opts)
        ):
            continue  # recomputes no less anywhere than a cheaper one, or does not fit
        # one pipeline simulated per class of identical ones: predict()'s step and memory
        found = predict_by_class(trimmed, config, cost, seq_len=seq_len, options=opts)
        out.append(found)
        if len(out) == 1 and found.step_time_s - most_saved(found) >= bound:
            break  # no variant can beat the fastest plan found
        if within_headroom(found, cost):
            simulated.append(counts)
            if not any(counts):
                break
    return out


def most_saved(found: Prediction) -> float:
    """An upper bound on the seconds a step could save without ``found``'s recompute: per
    pipeline, every micro-batch's recomputed forwards on every stage one after another."""
    counts = found.strategy.recomputed(found.options)
    saved = 0.0
    for p, pipe in enumerate(found.strategy.pipelines):
        per = sum(
            found.work[(p, s)].forward_s * counts[p][s] / len(stage.layers)
            for s, stage in enumerate(pipe.stages)
        )
        saved = max(saved, pipe.num_micro_batches * per)
    return saved


def _fits(
    strategy: Strategy, config: ModelSpec, cost: CostModel, *, seq_len: int,
    options: StrategyOptions,
) -> bool:  # fmt: skip
    """Whether every rank's peak is within its memory less the headroom (no simulation)."""
    memory = strategy_memory(strategy, config, seq_len=seq_len, options=options)
    limit = 1 - PLAN_HEADROOM
    return all(m.peak <= cost.device_of(r).memory_bytes * limit for r, m in memory.items())


def variants(stages: tuple[int, ...], *, uneven: bool = True) -> list[tuple[int, bool]]:
    """(stage, memory-proportional shares?) in the order of what they cost in time: the
    stages below 3 even (2 costs what 1 does), the highest of them with shares, then 3
    even and with shares.

    >>> variants((1, 2, 3))
    [(1, False), (2, False), (2, True), (3, False), (3, True)]
    >>> variants((1,)), variants((0,))
    ([(1, False), (1, True)], [(0, False)])
    """
    cheap = [z for z in stages if z < 3]
    out = [(z, False) for z in cheap]
    if uneven and cheap and cheap[-1] > 0:
        out.append((cheap[-1], True))
    if 3 in stages:
        out += [(3, False), (3, True)] if uneven else [(3, False)]
    return out
