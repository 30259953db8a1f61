"""Peak memory of each rank under a strategy: model states, activations, logits, overhead.

Per rank of a stage holding ``P`` parameters (its TP shard, ``cost.stage.stage_params``):

==================  ================================  =====================================
what                bf16 compute                      fp32 compute
==================  ================================  =====================================
weights             ``2*P`` (bf16 copy)               ``4*P`` (the masters themselves)
gradients           ``4*P`` (fp32)                    ``4*P``
masters + Adam      ``12*P / z``                      ``8*P / z`` (moments only)
==================  ================================  =====================================

``z`` is 1, or with ZeRO the number of pipelines that hold the stage's layers (the
data-parallel replicas its optimizer states are sharded over). ZeRO keeps fp32 masters of
its own under fp32 compute too (``hspmd.train.zero``), and shards more by stage
(``zero_states``; docs/zero.md)::

    stage  weights                         gradients                 masters + Adam
    0      e*P                             4*P                       (12 | 8)*P
    1      e*P                             4*P (+ 4*P/z fp32)        12*P/z
    2      e*P                             4*P/z + a bucket          12*P/z
    3      U or 2*U (per layer), e*P       4*P/z (+ a bucket, or     12*P/z (+ 2*P/z bf16
           (once per step)                 e*P once per step)        stored shards)

``e`` is the compute dtype's bytes, ``U`` the largest unit ZeRO-3 gathers (a layer, the
embedding or the head, ``largest_unit``; twice with the next one prefetched), a bucket
``min(e*P, ZERO_BUCKET_BYTES)`` of full gradients before their reduce. Where the pipelines
do not run in lock step and a stage has several micro-batches, the full gradient
accumulates until the last B (``e*P``), and ZeRO-3 holds the stage's whole parameters
through the step. Communication buffers in flight are not counted.

Activations kept per layer per micro-batch: what the model's own cost function says a block
keeps (``CostFunction.saved_bytes``; a captured model: what autograd saved on its graph).
For the Llama, what autograd saves in one block as the runtime runs it
(``hspmd.models.llama_cost.LlamaCost.token_bytes``; counted tensor by tensor on a real block
in ``tests/planner/test_memory.py``), per token, ``e`` the compute dtype's bytes:

- each RMS norm keeps its input (``eH``) and one fp32 reciprocal per token (``hspmd.fused_ops``),
  divided by ``t`` under sequence parallelism (the norm runs on the sequence shard);
- each of the two matmul groups (q/k/v, gate/up) keeps its input (``eH`` each), under
  sequence parallelism as its sequence shard, divided by ``t``: the runtime gathers it
  again in backward, as Megatron-LM does (``hspmd.runtime.regather``);
- attention keeps q and k after RoPE, v, its output and an fp32 log-sum-exp per head
  (``e(2q + 2kv) + 4 heads``, divided by ``t``; a fused kernel: no ``s*s`` scores);
- the MLP keeps gate, up and silu(gate) * up (``3eF``, divided by ``t``; silu is computed
  again in backward, ``hspmd.fused_ops.swiglu``).

With sequence parallelism that is 0.95-0.99x Korthikanti et al.'s ``34*s*b*H/t`` for a GELU
MLP (SwiGLU's three F-wide tensors against a GELU MLP's two 4H-wide ones). With
recompute only each layer's input stays (``e*s*b*H``, divided by ``t`` under sequence parallelism) plus one
layer's full set during its backward (``--recompute-layers k``: the first ``k`` layers of a
stage recompute, the others keep everything). Micro-batches in flight on stage ``i`` of ``S``:
``min(S - i, m)`` under 1F1B, ``m`` under GPipe. The last stage adds fp32 logits and their
gradient for one micro-batch, ``8*b*s*V/t``. Every rank adds ``OVERHEAD_BYTES`` (CUDA
context, NCCL buffers, allocator fragmentation), an assumption.

Any other model: a layer keeps what autograd saved in one of its blocks on the meta
device (``hspmd.models.spec.ModelCost``, the ``saved`` lines: divided by ``t`` where
deduction split them), in the compute dtype; with recompute its input, ``b*s*H``
elements (``/t`` under sequence parallelism); the logits term is ``8*b*s*V``, divided by
``t`` where the loss reads vocab-split logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from hspmd.cost.stage import cost_of, stage_params
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import lock_step
from hspmd.plan.strategy import Stage, Strategy, StrategyOptions

__all__ = [
    "OVERHEAD_BYTES",
    "ZERO_BUCKET_BYTES",
    "RankMemory",
    "StagePlace",
    "in_flight",
    "layer_holders",
    "largest_unit",
    "rank_memory",
    "stage_memory",
    "stage_places",
    "strategy_memory",
]

OVERHEAD_BYTES = 3 * 2**30  # assumed: CUDA context ~0.5 GiB, NCCL, fragmentation
ZERO_BUCKET_BYTES = 4 << 20  # ZeRO-2's gradient buckets (TrainConfig.runtime.bucket_bytes' default)


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes one rank needs at its peak, by component."""

    rank: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    overhead: float = OVERHEAD_BYTES

    @property
    def peak(self) -> float:
        return (
            self.weights + self.gradients + self.optimizer + self.activations + self.logits
            + self.overhead
        )  # fmt: skip


def in_flight(schedule: str, num_stages: int, stage: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at once."""
    if schedule == "gpipe":
        return num_micro_batches
    return min(num_stages - stage, num_micro_batches)


def activation_bytes_per_layer(
    config: ModelSpec, micro_batch_size: int, seq_len: int, tp: int, *, elt: int,
    sequence_parallel: bool, recompute: bool,
) -> tuple[float, float]:  # fmt: skip
    """(kept per layer per micro-batch, one layer's full set) in bytes: the full set is
    what the model's cost function says a block keeps (``CostFunction.saved_bytes``); a
    recomputed layer keeps its input only."""
    sp = sequence_parallel and tp > 1
    full = cost_of(config).saved_bytes(micro_batch_size, seq_len, tp, elt=elt, sequence_parallel=sp)
    if not recompute:
        return full, 0.0
    return micro_batch_size * seq_len * config.hidden_size * elt / (tp if sp else 1), full


def _activations(
    config: ModelSpec, micro_batch_size: int, seq_len: int, tp: int, *, elt: int,
    num_layers: int, in_flight: int, recomputed: int, sequence_parallel: bool,
) -> float:  # fmt: skip
    """A stage's activation bytes: ``recomputed`` of its layers keep their inputs only (plus
    one layer's full set while it recomputes), the others keep everything."""
    plain, _ = activation_bytes_per_layer(
        config, micro_batch_size, seq_len, tp, elt=elt,
        sequence_parallel=sequence_parallel, recompute=False,
    )  # fmt: skip
    if not recomputed:
        return num_layers * in_flight * plain
    kept, full = activation_bytes_per_layer(
        config, micro_batch_size, seq_len, tp, elt=elt,
        sequence_parallel=sequence_parallel, recompute=True,
    )  # fmt: skip
    return in_flight * (recomputed * kept + (num_layers - recomputed) * plain) + full


def rank_memory(
    config: ModelSpec, *, rank: int, tp: int, num_layers: int, first: bool, last: bool,
    in_flight_micro_batches: int, micro_batch_size: int, seq_len: int, replicas: int,
    options: StrategyOptions, cp: int = 1, recomputed: int | None = None,
    lock_step: bool = True, micro_batches: int = 1, prefetch: bool = True,
    share: float | None = None,
) -> RankMemory:  # fmt: skip
    """The memory of one rank of a stage (see the module docstring). ``recomputed``: the
    stage's own count of recomputed layers (``Stage.recompute``), else the options'. Under
    context parallelism (``cp > 1``) the layers' activations are those of ``seq_len / cp``
    positions, the logits those of whole rows (the head runs on the gathered sequence),
    without sequence parallelism (it applies to stages without CP only). ``lock_step``,
    ``micro_batches`` and ``prefetch`` shape ZeRO 2 and 3's terms (``zero_states``);
    ``share``: the part of each ZeRO shard this rank's replica holds (``--zero-shares``;
    None: ``1 / replicas``)."""
    p = stage_params(config, num_layers, tp, first=first, last=last)
    bf16 = options.dtype == "bf16"
    elt = 2 if bf16 else 4
    unit = largest_unit(config, tp, first=first, last=last)
    accumulates = not lock_step and micro_batches > 1
    weights, gradients, optimizer = zero_states(
        p, zero=options.zero, replicas=replicas, elt=elt,
        unit=unit, accumulates=accumulates, per_layer=lock_step, prefetch=prefetch, share=share,
    )  # fmt: skip
    activations = _activations(
        config, micro_batch_size, seq_len // cp, tp, elt=elt, num_layers=num_layers,
        in_flight=in_flight_micro_batches,
        recomputed=options.recomputed(num_layers) if recomputed is None else recomputed,
        sequence_parallel=options.sequence_parallel and cp == 1,
    )  # fmt: skip
    vocab_tp = tp if cost_of(config).vocab_split else 1
    logits = 8 * micro_batch_size * seq_len * config.vocab_size / vocab_tp if last else 0.0
    return RankMemory(rank, weights, gradients, optimizer, activations, logits)


def zero_states(
    p: float, *, zero: int, replicas: int, elt: int, unit: float = 0.0,
    accumulates: bool = False, per_layer: bool = True, prefetch: bool = True,
    share: float | None = None,
) -> tuple[float, float, float]:  # fmt: skip
    """(weights, gradients, masters + Adam) bytes of a rank holding ``p`` parameters under
    ZeRO stage ``zero`` over ``replicas`` (the module docstring's table, ``/z`` being
    ``* share`` where the shards are uneven; ``unit``: the largest gathered unit's
    parameters).

    >>> [round(sum(zero_states(1e8, zero=z, replicas=4, elt=4, unit=1e7)) / 1e8, 2)
    ...  for z in range(4)]
    [16.0, 12.0, 8.04, 4.8]
    """
    part = (share if share is not None else 1 / replicas) if zero else 1.0  # of each shard
    bucket = min(elt * p, ZERO_BUCKET_BYTES)
    optimizer = 12 * p * part if zero or elt == 2 else 8 * p
    if zero <= 1:
        gradients = 4 * p + (4 * p * part if zero and elt == 4 else 0)
        return elt * p, gradients, optimizer
    transient = elt * p if accumulates else bucket
    if zero == 2:
        return elt * p, 4 * p * part + transient, optimizer
    stored = 2 * p * part if elt == 2 else 0.0  # fp32: the masters are the stored shards
    if per_layer:
        return stored + elt * unit * (2 if prefetch else 1), 4 * p * part, optimizer
    return stored + elt * p, 4 * p * part + transient, optimizer


def largest_unit(config: ModelSpec, tp: int, *, first: bool, last: bool) -> int:
    """Parameters of the largest unit ZeRO-3 gathers on a rank of a stage: a layer, or the
    embedding (first stage) or the head and final norm (last stage)."""
    units = [stage_params(config, 1, tp, first=False, last=False)]
    if first:
        units.append(stage_params(config, 0, tp, first=True, last=False))
    if last:
        units.append(stage_params(config, 0, tp, first=False, last=True))
    return max(units)


def layer_holders(strategy: Strategy, num_layers: int) -> list[int]:
    """How many stages (one per pipeline) hold each layer: its data-parallel replicas."""
    holders = [0] * num_layers
    for _, _, stage in strategy.stages():
        for layer in stage.layers:
            holders[layer] += 1
    return holders


@dataclass(frozen=True, slots=True)
class StagePlace:
    """What a stage's memory reads of its place in the strategy."""

    first: bool
    last: bool
    in_flight: int  # micro-batches whose activations it holds at once
    micro_batch_size: int
    replicas: int  # pipelines holding its layers (ZeRO shards over them)
    lock_step: bool = True  # every pipeline runs the same schedule (hspmd.plan.params)
    micro_batches: int = 1
    share: float | None = None  # its part of each ZeRO shard (--zero-shares; None: even)


def stage_places(
    strategy: Strategy, num_layers: int, schedule: str, *, shares: tuple[float, ...] = ()
) -> Iterator[tuple[int, int, Stage, StagePlace]]:
    """``(pipeline index, stage index, stage, place)`` for every stage (``shares``: the
    pipelines' ZeRO weights, ``StrategyOptions.zero_shares``)."""
    holders = layer_holders(strategy, num_layers)
    together = lock_step(strategy)
    for p, pipeline in enumerate(strategy.pipelines):
        count = len(pipeline.stages)
        for i, stage in enumerate(pipeline.stages):
            yield p, i, stage, StagePlace(
                first=i == 0, last=i == count - 1,
                in_flight=in_flight(schedule, count, i, pipeline.num_micro_batches),
                micro_batch_size=pipeline.micro_batch_size,
                replicas=min((holders[layer] for layer in stage.layers), default=1),
                lock_step=together, micro_batches=pipeline.num_micro_batches,
                share=shares[p] / sum(shares) if shares else None,
            )  # fmt: skip


def stage_memory(
    config: ModelSpec, stage: Stage, place: StagePlace, *, seq_len: int,
    options: StrategyOptions, recomputed: int | None = None,
) -> RankMemory:  # fmt: skip
    """The memory of each rank of ``stage`` (its first rank's), recomputing ``recomputed``
    of its first layers (default: as the stage and ``options`` say)."""
    return rank_memory(
        config, rank=stage.ranks[0], tp=stage.tp, num_layers=len(stage.layers),
        first=place.first, last=place.last, in_flight_micro_batches=place.in_flight,
        micro_batch_size=place.micro_batch_size, seq_len=seq_len, replicas=place.replicas,
        options=options, cp=stage.cp,
        recomputed=stage.recomputed(options) if recomputed is None else recomputed,
        lock_step=place.lock_step, micro_batches=place.micro_batches, share=place.share,
    )  # fmt: skip


def strategy_memory(
    strategy: Strategy, config: ModelSpec, *, seq_len: int, options: StrategyOptions,
) -> dict[int, RankMemory]:  # fmt: skip
    """Every rank's memory under ``strategy`` (the ranks of a stage alike)."""
    out: dict[int, RankMemory] = {}
    places = stage_places(strategy, config.num_layers, options.schedule, shares=options.zero_shares)
    for _, _, stage, place in places:
        memory = stage_memory(config, stage, place, seq_len=seq_len, options=options)
        for rank in stage.ranks:
            out[rank] = replace(memory, rank=rank)
    return out
