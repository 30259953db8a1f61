"""Predict one training step of a strategy: the runtime's schedules as simulator tasks.

Each stage runs the schedule the runtime runs (``specialize.schedule.make_schedule``: the
same Pre/F/B/Post lists), one task per action, as a collective over the stage's TP ranks
(they compute in lock step). Activations and gradients travel as tasks on the sender's
``send`` stream (non-blocking sends, as the runtime's ``isend``), holding the sender's
``out`` and the receiver's ``in`` port so one port carries one message at a time. After
the last backward, Post runs the plans the trainer runs (``hspmd.specialize.sync_plans``:
the gradient sync across pipelines, or ZeRO's reduces and gathers), priced by
``hspmd.cost.comm_plans`` and grouped into tasks by segment (``hspmd.planner.sync_tasks``),
and each rank's Adam step.

With ZeRO-3 (``zero_gathers``) Post keeps the reduce-scatter and drops the all-gather: the
weights are gathered where the runtime gathers them (docs/zero.md). Where the pipelines run
in lock step, each F and each B gathers every layer (the embedding and the head as one
more) over the stage's replicas, the next one prefetched: the first gather is exposed, each
later one only by what it takes beyond the previous layer's compute; otherwise the stage is
gathered once per step, its time spread over the F's. The reduce of every B but the last
(lock step) is not priced: it overlaps backward. Under uneven shards (``--zero-shares``)
each gather takes ``hspmd.planner.shard_parts.exchange_factor`` times as long (the replica
holding the most sets the pace; the reduces' and ZeRO-1/2's gathers' plans carry the
uneven parts themselves) and each replica's Adam runs on its own part.

Durations come from ``hspmd.cost.lines`` via ``hspmd.cost.stage``; memory from
``hspmd.planner.memory``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hspmd.cost.lines import CostModel
from hspmd.cost.stage import (
    StageWork,
    stage_params,
    stage_work,
)
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import lock_step
from hspmd.plan.strategy import Pipeline, Stage, Strategy, StrategyOptions
from hspmd.planner.memory import RankMemory, strategy_memory
from hspmd.planner.shard_parts import exchange_factor, shard_parts
from hspmd.planner.sync_tasks import (
    OVERLAP_PIECES,
    Segment,
    busy_cores,
    last_b_pieces,
    post_plans,
    segments,
    sync_tasks,
)
from hspmd.sim.engine import Result, Task, simulate
from hspmd.sim.restrict import restricted
from hspmd.specialize.schedule import make_schedule

GRAD_BYTES = 4  # gradients are synced in fp32 (the masters' dtype)

__all__ = ["Prediction", "Segment", "predict", "segments", "step_tasks"]


@dataclass(frozen=True)
class Prediction:
    """A simulated step: ``step_time_s``, the engine's ``result``, memory per rank, and
    ``over``: ranks whose peak exceeds their device's memory (rank -> (peak, cap))."""

    strategy: Strategy
    options: StrategyOptions
    step_time_s: float
    result: Result
    memory: Mapping[int, RankMemory]
    over: dict[int, tuple[float, float]] = field(default_factory=dict)
    work: dict[tuple[int, int], StageWork] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.over

    def peak_by_kind(self, cost: CostModel) -> dict[str, float]:
        peaks: dict[str, float] = {}
        for rank, mem in self.memory.items():
            kind = cost.kind_of(rank)
            peaks[kind] = max(peaks.get(kind, 0.0), mem.peak)
        return peaks

    def plan_json(self, cost: CostModel) -> dict[str, Any]:
        """The plan's fields of ``hspmd plan --json``: the strategy, its options as
        ``hspmd train`` takes them, the step and the peak memory per kind."""
        recomputed = self.strategy.recomputed(self.options)
        return {
            "strategy": str(self.strategy),
            "zero1": self.options.zero1,
            "zero": self.options.zero,
            "zero_shares": list(self.options.zero_shares),
            "recompute": any(k for ks in recomputed for k in ks),
            "recompute_layers": [list(ks) for ks in recomputed],
            "sequence_parallel": self.options.sequence_parallel,
            "micro_batch_size": self.strategy.pipelines[0].micro_batch_size,
            "step_time_s": self.step_time_s,
            "peak_memory_by_kind": self.peak_by_kind(cost),
        }

    def to_json(self, cost: CostModel) -> dict[str, Any]:
        summary = self.result.to_json()
        return {
            "strategy": str(self.strategy),
            "options": str(self.options),
            "step_time_s": self.step_time_s,
            "fits": self.fits,
            "peak_memory_by_kind": self.peak_by_kind(cost),
            "ranks": {
                str(r): {
                    **summary["ranks"].get(str(r), {}),
                    "kind": cost.kind_of(r),
                    "peak_memory": self.memory[r].peak,
                    "memory_cap": cost.device_of(r).memory_bytes,
                }
                for r in sorted(self.memory)
            },
            "over_memory": {str(r): {"peak": p, "cap": c} for r, (p, c) in self.over.items()},
            "critical_path": summary["critical_path"],
            "time_by_category": summary["time_by_category"],
        }


def _ports(src: Stage, dst: Stage) -> tuple[str, ...]:
    return (f"out:{src.ranks[0]}", f"in:{dst.ranks[0]}")


def _overlapped(cost: CostModel, strategy: Strategy) -> bool:
    """Whether the gradient sync runs beside the last backward, as the runtime issues it
    (``hspmd.train.overlap``): on devices with streams of their own, not on CPU processes
    (a CPU-profiled kind, or a cluster emulated on one machine: there the sync takes the
    cores the backward needs)."""
    if cost.cluster.one_host:
        return False
    return not any(cost.device_of(st.ranks[0]).cpu for _, _, st in strategy.stages())


def _pipeline_tasks(
    p: int, pipeline: Pipeline, works: Sequence[StageWork], cost: CostModel, schedule: str,
    pieces: dict[int, list[tuple[str, int]]] | None = None,
) -> list[Task]:  # fmt: skip
    """``pieces``: per stage, its last backward cut so the gradient sync can start on the
    layers it has finished (``last_b_pieces``)."""
    tasks: list[Task] = []
    count, m = len(pipeline.stages), pipeline.num_micro_batches
    pieces = pieces or {}
    for s, stage in enumerate(pipeline.stages):
        ranks, leader, work = stage.ranks, stage.ranks[0], works[s]
        # the same for every micro-batch: computed once per stage (65,536 ranks: 500k tasks)
        group = ranks if len(ranks) > 1 else ()
        share, stage_busy = cost.share_of(leader), busy_cores(cost, ranks)
        sends: dict[str, float] = {}  # action kind -> the send after it
        for action in make_schedule(schedule, count, s, m):
            if action.kind not in ("F", "B"):
                continue
            i, tid = action.micro_batch, f"p{p}s{s}{action}"
            if action.kind == "F":
                deps = (f"p{p}s{s - 1}aF{i}",) if s > 0 else ()
                duration, comm = work.forward_s, work.forward_comm_s
            else:
                deps = (f"p{p}s{s + 1}gB{i}",) if s < count - 1 else ()
                duration, comm = work.backward_s, work.backward_comm_s
            busy = stage_busy
            measured_at = 1  # the compute's line is a rank's time alone
            if share and comm > 0:
                # On a shared CPU host the TP collectives' fits hold with their group's
                # processes active (the profile ran them so); more processes busy on the
                # host slow them as they slow the compute (a wake-up waits for a core).
                tasks.append(Task(f"{tid}:compute", leader, "compute", duration - comm,
                                  category=action.kind, deps=deps, label=str(action),
                                  ranks=group, share=share, weight=busy))  # fmt: skip
                duration, deps, measured_at, busy = comm, (f"{tid}:compute",), len(ranks), None
            cut = pieces.get(s, []) if action.kind == "B" and i == m - 1 else []
            total, whole = sum(n for _, n in cut), duration
            for piece, layers in cut[:-1]:  # the last layers' gradients are final first
                part = whole * layers / total
                tasks.append(Task(piece, leader, "compute", part, category=action.kind,
                                  deps=deps, label=str(action), ranks=group))  # fmt: skip
                duration, deps = duration - part, (piece,)
            tasks.append(Task(tid, leader, "compute", duration, category=action.kind,
                              deps=deps, label=str(action), ranks=group, share=share,
                              measured_at=measured_at, weight=busy))  # fmt: skip
            nxt = s + 1 if action.kind == "F" else s - 1
            if 0 <= nxt < count:
                peer = pipeline.stages[nxt]
                send = sends.get(action.kind)
                if send is None:
                    width = min(len(ranks), len(peer.ranks))
                    # each of the ``width`` rank pairs carries its share of the activation
                    send = cost.send(work.activation_bytes / width, leader, peer.ranks[0])
                    sends[action.kind] = send
                kind = "a" if action.kind == "F" else "g"
                tasks.append(Task(f"p{p}s{s}{kind}{action}", leader, "send", send,
                                  category="comm", deps=(tid,), resources=_ports(stage, peer),
                                  label=f"{kind}{action}"))  # fmt: skip
    return tasks


def stage_works(
    strategy: Strategy, config: ModelSpec, cost: CostModel, *, seq_len: int,
    options: StrategyOptions, pipelines: Collection[int] | None = None,
) -> dict[tuple[int, int], StageWork]:  # fmt: skip
    """The per-micro-batch work of every ``(pipeline, stage)`` (of ``pipelines`` only)."""
    works = {}
    for p, s, stage in strategy.stages():
        if pipelines is not None and p not in pipelines:
            continue
        pipe = strategy.pipelines[p]
        redo = stage.recomputed(options)
        works[(p, s)] = stage_work(
            cost, config, stage.ranks, len(stage.layers), micro_batch_size=pipe.micro_batch_size,
            seq_len=seq_len, first=s == 0, last=s == len(pipe.stages) - 1,
            recompute=redo > 0, sequence_parallel=options.sequence_parallel,
            cp=stage.cp, recompute_layers=redo,
        )  # fmt: skip
        if options.zero == 3 and len(strategy.pipelines) > 1:
            works[(p, s)] = zero_gathers(
                works[(p, s)], strategy, config, cost, p=p, s=s, shares=options.zero_shares
            )
    return works


def zero_gathers(
    work: StageWork, strategy: Strategy, config: ModelSpec, cost: CostModel, *, p: int, s: int,
    shares: tuple[float, ...] = (),
) -> StageWork:  # fmt: skip
    """``work`` with ZeRO-3's parameter gathers added (module docstring; ``shares``: the
    pipelines' uneven parts, ``hspmd.planner.shard_parts``)."""
    pipe = strategy.pipelines[p]
    stage = pipe.stages[s]
    ring = tuple(q.stage_of_layer(stage.first_layer).ranks[0] for q in strategy.pipelines)
    first, last = s == 0, s == len(pipe.stages) - 1
    elt = cost.element_bytes * exchange_factor(shard_parts(shares) if shares else ())
    if not lock_step(strategy):  # once per step, spread over the F's
        whole = stage_params(config, len(stage.layers), stage.tp, first=first, last=last)
        seconds = cost.collective("all-gather", whole * elt, ring, stage.tp)
        share = seconds / pipe.num_micro_batches
        return dataclasses.replace(
            work, forward_s=work.forward_s + share, forward_comm_s=work.forward_comm_s + share,
            tp_comm_s=work.tp_comm_s + share,
        )  # fmt: skip
    units = len(stage.layers) + int(first) + int(last)
    layer = stage_params(config, 1, stage.tp, first=False, last=False)
    gather = cost.collective("all-gather", layer * elt, ring, stage.tp)

    def exposed(compute_s: float) -> float:  # the first gather, then what compute hides not
        return gather + (units - 1) * max(0.0, gather - compute_s / units)

    f, b = exposed(work.forward_s), exposed(work.backward_s)
    return dataclasses.replace(
        work, forward_s=work.forward_s + f, backward_s=work.backward_s + b,
        forward_comm_s=work.forward_comm_s + f, tp_comm_s=work.tp_comm_s + f + b,
    )  # fmt: skip


def step_tasks(
    strategy: Strategy, config: ModelSpec, cost: CostModel, *, seq_len: int,
    options: StrategyOptions, pipelines: Sequence[int] | None = None,
) -> tuple[list[Task], dict[tuple[int, int], StageWork]]:  # fmt: skip
    """The simulator tasks of one step, and the stage works they were built from.
    ``pipelines``: those pipelines' tasks only, the gradient sync's collectives restricted
    to their ranks (``hspmd.sim.restrict``: for pipelines the others mirror,
    ``hspmd.planner.pipeline_classes``)."""
    chosen = range(len(strategy.pipelines)) if pipelines is None else pipelines
    works = stage_works(
        strategy, config, cost, seq_len=seq_len, options=options, pipelines=pipelines
    )  # fmt: skip
    tasks: list[Task] = []
    # Post's plans, and the segments their tasks group by (none without a sync), cut where
    # the sync overlaps backward
    plans = post_plans(strategy, config, options, element_bytes=cost.element_bytes)
    overlap = _overlapped(cost, strategy)
    cut = OVERLAP_PIECES if overlap else 1
    segs = segments(strategy, config, pieces=cut) if plans.reduces else []
    for p in chosen:
        pipeline = strategy.pipelines[p]
        per_stage = [works[(p, s)] for s in range(len(pipeline.stages))]
        pieces = {
            s: last_b_pieces(p, s, pipeline, segs)
            for s in range(len(pipeline.stages))
            if segs and overlap
        }
        tasks += _pipeline_tasks(p, pipeline, per_stage, cost, options.schedule, pieces)
    tasks += sync_tasks(strategy, config, cost, options, plans=plans, segs=segs, overlap=overlap)
    if pipelines is not None:
        tasks = restricted(tasks, {r for p in pipelines for r in strategy.pipelines[p].ranks})
    return tasks, works


def predict(
    strategy: Strategy, config: ModelSpec, cost: CostModel, *, seq_len: int,
    options: StrategyOptions,
) -> Prediction:  # fmt: skip
    """Simulate one step of ``strategy`` and check every rank's memory against its cap."""
    tasks, works = step_tasks(strategy, config, cost, seq_len=seq_len, options=options)
    result = simulate(tasks, pools=cost.pools())
    memory = strategy_memory(strategy, config, seq_len=seq_len, options=options)
    over = {}
    for rank, mem in memory.items():
        cap = cost.device_of(rank).memory_bytes
        if mem.peak > cap:
            over[rank] = (mem.peak, cap)
    return Prediction(strategy, options, result.makespan, result, memory, over, works)


class Predicted:
    """What a plan reads through its ``prediction``: the strategy, options and step time."""

    prediction: Prediction

    @property
    def strategy(self) -> Strategy:
        return self.prediction.strategy

    @property
    def options(self) -> StrategyOptions:
        return self.prediction.options

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s
