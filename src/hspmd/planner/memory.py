"""Peak memory of each rank under a strategy: model states, activations, logits, overhead.

Per rank of a stage holding ``P`` parameters (its TP shard, ``workload.stage_params``):

==================  ================================  =====================================
what                bf16 compute                      fp32 compute
==================  ================================  =====================================
weights             ``2*P`` (bf16 copy)               ``4*P`` (the masters themselves)
gradients           ``4*P`` (fp32)                    ``4*P``
masters + Adam      ``12*P / z``                      ``8*P / z`` (moments only)
==================  ================================  =====================================

``z`` is 1, or with ZeRO-1 the number of pipelines that hold the stage's layers (the
data-parallel replicas its optimizer states are sharded over).

Activations kept per layer per micro-batch (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", with a fused attention kernel so no ``s*s``
scores are kept): ``s*b*H*(10 + 24/t)`` bytes in 2-byte activations,
``s*b*H*34/t`` with sequence parallelism; twice that in fp32. With recompute only each
layer's input stays (``2*s*b*H``, divided by ``t`` under sequence parallelism) plus one
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

from dataclasses import dataclass

from hspmd.models.config import LlamaConfig
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import Strategy, StrategyOptions
from hspmd.planner.workload import figures, stage_params

__all__ = [
    "OVERHEAD_BYTES",
    "RankMemory",
    "in_flight",
    "layer_holders",
    "rank_memory",
    "strategy_memory",
]

OVERHEAD_BYTES = 3 * 2**30  # assumed: CUDA context ~0.5 GiB, NCCL, fragmentation


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
    """(kept per layer per micro-batch, one layer's full set) in bytes."""
    if not isinstance(config, LlamaConfig):
        sp = sequence_parallel and tp > 1
        full = elt * sum(
            w.units.at(micro_batch_size, seq_len) / (tp if (w.split_sp if sp else w.split) else 1)
            for w in figures(config).layer.saved
        )
        if not recompute:
            return full, 0.0
        return micro_batch_size * seq_len * config.hidden_size * elt / (tp if sp else 1), full
    sbh = seq_len * micro_batch_size * config.hidden_size * elt / 2
    full = sbh * 34 / tp if sequence_parallel and tp > 1 else sbh * (10 + 24 / tp)
    if not recompute:
        return full, 0.0
    kept = 2 * sbh / (tp if sequence_parallel and tp > 1 else 1)
    return kept, full


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
    options: StrategyOptions, cp: int = 1,
) -> RankMemory:  # fmt: skip
    """The memory of one rank of a stage (see the module docstring); under context
    parallelism (``cp > 1``) the layers' activations are those of ``seq_len / cp``
    positions, the logits those of whole rows (the head runs on the gathered sequence),
    without sequence parallelism (it applies to stages without CP only)."""
    p = stage_params(config, num_layers, tp, first=first, last=last)
    bf16 = options.dtype == "bf16"
    z = replicas if options.zero1 else 1
    weights = (2 if bf16 else 4) * p
    optimizer = (12 if bf16 else 8) * p / z
    elt = 2 if bf16 else 4
    activations = _activations(
        config, micro_batch_size, seq_len // cp, tp, elt=elt, num_layers=num_layers,
        in_flight=in_flight_micro_batches, recomputed=options.recomputed(num_layers),
        sequence_parallel=options.sequence_parallel and cp == 1,
    )  # fmt: skip
    vocab_tp = tp if isinstance(config, LlamaConfig) or figures(config).vocab_split else 1
    logits = 8 * micro_batch_size * seq_len * config.vocab_size / vocab_tp if last else 0.0
    return RankMemory(rank, weights, 4 * p, optimizer, activations, logits)


def layer_holders(strategy: Strategy, num_layers: int) -> list[int]:
    """How many stages (one per pipeline) hold each layer: its data-parallel replicas."""
    holders = [0] * num_layers
    for _, _, stage in strategy.stages():
        for layer in stage.layers:
            holders[layer] += 1
    return holders


def strategy_memory(
    strategy: Strategy, config: ModelSpec, *, seq_len: int, options: StrategyOptions,
) -> dict[int, RankMemory]:  # fmt: skip
    """Every rank's memory under ``strategy``."""
    holders = layer_holders(strategy, config.num_layers)
    out: dict[int, RankMemory] = {}
    for pipeline in strategy.pipelines:
        count = len(pipeline.stages)
        for i, stage in enumerate(pipeline.stages):
            replicas = min((holders[layer] for layer in stage.layers), default=1)
            flight = in_flight(options.schedule, count, i, pipeline.num_micro_batches)
            for rank in stage.ranks:
                out[rank] = rank_memory(
                    config, rank=rank, tp=stage.tp, num_layers=len(stage.layers),
                    first=i == 0, last=i == count - 1, in_flight_micro_batches=flight,
                    micro_batch_size=pipeline.micro_batch_size, seq_len=seq_len,
                    replicas=replicas, options=options, cp=stage.cp,
                )  # fmt: skip
    return out
