"""DeepSpeed's plans in the simulator: ZeRO-3 over every rank, Ulysses SP, checkpointing.

The paper's DeepSpeed baselines (Tables 8, 10 and 13 of the HSPMD paper) are written
``DP8SP2AC, bs2``: ``dp`` data-parallel groups of ``sp`` ranks each running Ulysses
sequence parallelism, activation checkpointing (``AC``), micro-batch size ``bs``, and
ZeRO-3 over all ``dp * sp`` ranks. Here such a plan is

- a strategy of ``dp`` pipelines of one stage each, ``sp`` consecutive ranks with CP degree
  ``sp`` (``R0-1:L0-59:C2``): the cost model's CP *is* Ulysses (``cost.stage.stage_work``: every
  per-token op on ``1/sp`` of the tokens, attention on whole rows of ``heads / sp`` heads,
  four all-to-alls of q, k, v and the output each way per layer), with every layer's
  forward run again in backward under ``AC``;
- ZeRO-3 over the ``N = dp * sp`` ranks: before each unit's forward (a layer, or the
  embedding or the head; a mean unit here, the model's parameters over the units) an
  all-gather of its compute-dtype weights over all ``N`` ranks, one more before its
  backward (the checkpointed forward and the backward of a unit run back to back on the
  same gathered weights), and a reduce-scatter of its gradient in the compute dtype
  (DeepSpeed's default communication dtype) after it, in every micro-batch. The next
  unit's gather is prefetched: the first gather of a pass is exposed, each later one only
  by what it and the previous reduce take beyond one unit's compute;
- in lock step: those collectives span every rank, so each micro-batch's forward and
  backward take the slowest group's time on every group (one collective task each in the
  simulator), then Adam on each rank's ``1/N`` of the parameters.

DeepSpeed needs ``dp * bs * accumulation`` samples a step; a global batch that ``dp``
does not divide (the paper's ``DP24`` at batch 64) is rounded up to ``ceil(B / dp)``
samples per group, which costs nothing more in lock step (the groups with fewer samples
would wait for the slowest anyway). Micro-batches of ``bs`` samples, or of the largest
divisor of a group's samples below it.

Memory per rank (``hspmd.planner.memory``): ``zero_states`` of the whole model at stage 3
over ``N`` (stored shards, two gathered units, gradient and Adam shards), the activations
of ``seq_len / sp`` positions with checkpointing (each layer's input plus one layer's
whole set), fp32 logits and their gradient of the local positions (the head runs on the
sequence shard), the per-rank overhead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from hspmd.cost.lines import CostModel
from hspmd.cost.stage import StageWork, stage_params, stage_work
from hspmd.errors import HspmdError
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import Pipeline, Stage, Strategy, StrategyOptions
from hspmd.planner.closed_form import fastest_fitting
from hspmd.planner.memory import (
    RankMemory,
    activation_bytes_per_layer,
    largest_unit,
    zero_states,
)
from hspmd.planner.predict import Prediction
from hspmd.sim.engine import Task, simulate

__all__ = [
    "DeepSpeedPlan", "best_deepspeed", "deepspeed_strategy", "parse_deepspeed",
    "predict_deepspeed",
]  # fmt: skip


class DeepSpeedError(HspmdError, ValueError):
    """A DeepSpeed plan that does not fit the cluster or the model."""


@dataclass(frozen=True, slots=True)
class DeepSpeedPlan:
    """``dp`` groups of ``sp`` Ulysses ranks, micro-batch size, activation checkpointing.

    >>> plan = parse_deepspeed("DP8SP2AC, bs2")
    >>> plan, plan.num_ranks
    (DeepSpeedPlan(dp=8, sp=2, micro_batch_size=2, checkpointing=True), 16)
    >>> str(plan)
    'DP8SP2AC, bs2'
    """

    dp: int
    sp: int
    micro_batch_size: int
    checkpointing: bool = True

    @property
    def num_ranks(self) -> int:
        return self.dp * self.sp

    def __str__(self) -> str:
        ac = "AC" if self.checkpointing else ""
        return f"DP{self.dp}SP{self.sp}{ac}, bs{self.micro_batch_size}"


def parse_deepspeed(text: str) -> DeepSpeedPlan:
    """``"DP8SP2AC, bs2"`` (the paper's notation; ``SP1`` and no ``AC`` allowed)."""
    match = re.fullmatch(r"\s*DP(\d+)(?:SP(\d+))?(AC)?\s*,\s*bs(\d+)\s*", text)
    if not match or int(match[1]) < 1 or int(match[4]) < 1 or int(match[2] or 1) < 1:
        raise DeepSpeedError(f"DeepSpeed plan {text!r}: write it as DP<d>SP<s>[AC], bs<b>")
    return DeepSpeedPlan(int(match[1]), int(match[2] or 1), int(match[4]), match[3] == "AC")


def deepspeed_strategy(
    plan: DeepSpeedPlan, num_layers: int, *, global_batch: int, ranks: Sequence[int]
) -> Strategy:
    """``dp`` pipelines of one ``sp``-rank Ulysses stage over ``ranks`` in order, each with
    ``ceil(global_batch / dp)`` samples (module docstring)."""
    if len(ranks) < plan.num_ranks:
        raise DeepSpeedError(
            f"DeepSpeed plan {plan} needs {plan.num_ranks} ranks; the cluster has {len(ranks)}"
        )
    samples = math.ceil(global_batch / plan.dp)
    size = max(b for b in range(1, min(plan.micro_batch_size, samples) + 1) if samples % b == 0)
    pipelines = tuple(
        Pipeline(
            samples // size,
            size,
            (Stage(tuple(ranks[g * plan.sp : (g + 1) * plan.sp]), 0, num_layers - 1, plan.sp),),
        )  # fmt: skip
        for g in range(plan.dp)
    )
    return Strategy(pipelines)


def predict_deepspeed(
    plan: DeepSpeedPlan, config: ModelSpec, cost: CostModel, *, global_batch: int,
    seq_len: int, ranks: Sequence[int] | None = None,
) -> Prediction:  # fmt: skip
    """One simulated step of ``plan`` on ``ranks`` (default: the cluster's first
    ``dp * sp``) and every rank's memory (module docstring)."""
    pool = list(range(cost.num_ranks)) if ranks is None else list(ranks)
    heads = [m.trailing[0] for m in config.markers() if m.placement == "heads"]
    if seq_len % plan.sp or any(n % plan.sp for n in heads):
        raise DeepSpeedError(
            f"DeepSpeed plan {plan}: Ulysses SP {plan.sp} must divide seq_len {seq_len} and "
            f"the heads of every attention tensor ({sorted(set(heads))})"
        )
    strategy = deepspeed_strategy(plan, config.num_layers, global_batch=global_batch, ranks=pool)
    options = StrategyOptions(zero=3, recompute=plan.checkpointing, dtype=cost.dtype)
    every = tuple(strategy.ranks)
    pipe = strategy.pipelines[0]
    works = {
        (p, 0): stage_work(
            cost,
            config,
            pipeline.stages[0].ranks,
            config.num_layers,
            micro_batch_size=pipe.micro_batch_size,
            seq_len=seq_len,
            first=True,
            last=True,
            recompute=plan.checkpointing,
            cp=plan.sp,
        )  # fmt: skip
        for p, pipeline in enumerate(strategy.pipelines)
    }
    forward, backward = _with_gathers(list(works.values()), config, cost, every)
    tasks: list[Task] = []
    for i in range(pipe.num_micro_batches):  # every group at the slowest group's pace
        for kind, seconds in (("F", forward), ("B", backward)):
            deps = (tasks[-1].id,) if tasks else ()
            tasks.append(Task(f"{kind}{i}", every[0], "compute", seconds, category=kind,
                              deps=deps, ranks=every, label=f"{kind}{i}"))  # fmt: skip
    params = stage_params(config, config.num_layers, 1, first=True, last=True)
    slowest = max((cost.device_of(r) for r in every), key=lambda d: d.seconds("optimizer", 1e9))
    adam = slowest.seconds("optimizer", 4 * params / len(every))
    tasks.append(Task("adam", every[0], "compute", adam, category="optimizer",
                      deps=(tasks[-1].id,), ranks=every, label="Adam"))  # fmt: skip
    result = simulate(tasks)
    memory = {r: _rank_memory(plan, config, r, seq_len=seq_len, mbs=pipe.micro_batch_size,
                              replicas=len(every), elt=cost.element_bytes) for r in every}  # fmt: skip
    over = {
        r: (m.peak, cost.device_of(r).memory_bytes)
        for r, m in memory.items()
        if m.peak > cost.device_of(r).memory_bytes
    }
    return Prediction(strategy, options, result.makespan, result, memory, over, works)


def best_deepspeed(
    config: ModelSpec, cost: CostModel, *, global_batch: int, seq_len: int,
    ranks: Sequence[int] | None = None, sizes: Sequence[int] = (1, 2, 4),
) -> tuple[DeepSpeedPlan, Prediction] | None:  # fmt: skip
    """The fastest DeepSpeed plan over all of ``ranks`` that fits with the planner's
    headroom: every SP degree that divides the ranks, the heads and ``seq_len`` and stays
    inside a node, micro-batch sizes ``sizes``, checkpointing on and off (the search whose
    results the paper's Tables 8, 10 and 13 report); None if none fits."""
    pool = list(range(cost.num_ranks)) if ranks is None else list(ranks)
    node = min(g.gpus_per_node for g in cost.cluster.groups)
    heads = getattr(config, "num_heads", 1)
    plans = [
        DeepSpeedPlan(len(pool) // sp, sp, bs, ac)
        for sp in range(1, node + 1)
        if len(pool) % sp == 0 and seq_len % sp == 0 and heads % sp == 0
        for bs in sizes
        for ac in (True, False)
    ]
    found = {
        plan: predict_deepspeed(
            plan, config, cost, global_batch=global_batch, seq_len=seq_len, ranks=pool
        )  # fmt: skip
        for plan in plans
    }
    best = fastest_fitting(list(found.values()), cost)
    return None if best is None else next((k, v) for k, v in found.items() if v is best)


def _with_gathers(
    works: Sequence[StageWork], config: ModelSpec, cost: CostModel, ranks: tuple[int, ...]
) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch at the slowest group's pace, with
    ZeRO-3's gathers and reduces over all ``ranks`` as far as compute does not hide them."""
    forward = max(w.forward_s for w in works)
    backward = max(w.backward_s for w in works)
    units = config.num_layers + 2  # the layers, the embedding, the final norm and head
    unit_bytes = stage_params(config, config.num_layers, 1, first=True, last=True) / units
    unit_bytes *= cost.element_bytes
    gather = cost.collective("all-gather", unit_bytes, ranks)
    reduce = cost.collective("reduce-scatter", unit_bytes, ranks)
    ahead = gather + (units - 1) * max(0.0, gather - forward / units)
    behind = gather + reduce + (units - 1) * max(0.0, gather + reduce - backward / units)
    return forward + ahead, backward + behind


def _rank_memory(
    plan: DeepSpeedPlan, config: ModelSpec, rank: int, *, seq_len: int, mbs: int,
    replicas: int, elt: int,
) -> RankMemory:  # fmt: skip
    params = stage_params(config, config.num_layers, 1, first=True, last=True)
    unit = largest_unit(config, 1, first=True, last=True)
    weights, gradients, optimizer = zero_states(
        params, zero=3, replicas=replicas, elt=elt, unit=unit, per_layer=True, prefetch=True
    )
    local = seq_len // plan.sp
    kept, full = activation_bytes_per_layer(
        config, mbs, local, 1, elt=elt, sequence_parallel=False, recompute=plan.checkpointing
    )
    activations = (
        config.num_layers * kept + full if plan.checkpointing else config.num_layers * kept
    )
    logits = 8 * mbs * local * config.vocab_size
    return RankMemory(rank, weights, gradients, optimizer, activations, logits)
