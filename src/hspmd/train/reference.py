"""The reference run: the plain model on one process, no hspmd, same data and batch.

Variable-length steps (``TrainConfig.batch.step_tokens``) run every micro-batch of the
strategy's packing here, one after another, weighted as the distributed run weighs them.

Dropout and attention dropout draw their masks by position (``hspmd.randomness``): the
step, the rows of the global batch (pass k of gradient accumulation: rows from
``k * global_batch``) and the call's number in the forward, as every strategy draws them.

Every distributed run must equal this one (first-step loss to 1e-5 relative, parameters
after a few Adam steps to 1e-4 relative in fp32). It runs the recipe with torch's own
parts, not ours: ``torch.optim.AdamW`` with two parameter groups (decayed and exempt, by
``hspmd.train.optim.decays``), ``torch.nn.utils.clip_grad_norm_`` on the whole module,
and the learning rate of ``hspmd.train.lr.learning_rate`` set in the groups before each
step; gradient accumulation is ``grad_accum`` backward passes of loss / grad_accum. So it
is an independent oracle for the optimizer, the clipping norm and accumulation (the
schedule is checked against torch's schedulers in tests/train/test_recipe.py).

>>> from hspmd.train.config import BatchConfig, ModelChoice
>>> config = TrainConfig(batch=BatchConfig(global_batch=2, seq_len=8), steps=1,
...                      model=ModelChoice(overrides=(("num_layers", 1),)))
>>> result = run_reference(config)
>>> len(result.records), 5.0 < result.records[0].loss < 6.0
(1, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
from torch import nn

from hspmd.models.build import plain_model, step_loss
from hspmd.models.spec import ModelSpec
from hspmd.randomness import positional_dropout
from hspmd.train.batches import accumulation_passes, check_data, eval_batches, step_batches
from hspmd.train.config import AdamConfig, EvalRecord, Record, StepRecord, TrainConfig, TrainError
from hspmd.train.device import reference_device
from hspmd.train.evaluate import evaluate_reference
from hspmd.train.lr import learning_rate
from hspmd.train.noise_floor import NoiseFloor
from hspmd.train.optim import decays
from hspmd.train.packing import (
    PackedStep,
    check_packed_dropout,
    packed_steps,
    planned_steps,
    record_fields,
)

__all__ = ["TrainResult", "param_groups", "run_reference"]


@dataclass(frozen=True, slots=True)
class TrainResult:
    """Per-step records and the final parameters at global shapes (name -> fp32 tensor);
    ``trace``: the run's Chrome trace when it was traced (``hspmd.runtime.trace``);
    ``evaluations``: the held-out evaluations (``TrainConfig.evaluation``)."""

    records: tuple[StepRecord, ...]
    params: dict[str, torch.Tensor]
    _: KW_ONLY
    trace: dict[str, Any] | None = None
    builds: int = 0  # executables a rank built and ran (one per strategy: lengths are symbolic)
    # CUDA runs: torch.cuda.max_memory_allocated of each rank (by rank) over the run, as
    # its process measured it; empty on CPU
    peak_memory: dict[int, int] = field(default_factory=dict)
    evaluations: tuple[EvalRecord, ...] = ()
    # with measure_memory: each rank's peak training-state bytes (hspmd.train.meter)
    state_peak: dict[int, int] = field(default_factory=dict)
    # the reference's: per parameter, the elements whose gradient was fp32 noise at every
    # step (hspmd.train.noise_floor; boolean masks, only parameters that have any)
    noise_only: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def losses(self) -> tuple[float, ...]:
        return tuple(r.loss for r in self.records)


def build_reference_model(config: TrainConfig) -> nn.Module:
    """The single-device model with the plan-independent initial weights."""
    return plain_model(config.model_config(), seed=config.seed)


def run_reference(
    config: TrainConfig, *, on_step: Callable[[Record], None] | None = None
) -> TrainResult:
    """Train the plain model for ``config.steps`` steps on the whole global batch, on
    ``reference_device(config)`` (CUDA when there is a GPU, unless ``device="cpu"``); the
    weights start on CPU from the seed (DESIGN decision 5) and the result is on CPU.
    ``on_step(record)`` after each step and each evaluation (``hspmd.train.evaluate``)."""
    config.check_model()
    check_data(config)  # bad data: one line, not a traceback from the first step
    device = reference_device(config)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = build_reference_model(config).to(device)
    spec = config.model_config()
    a = config.optimizer
    optimizer = torch.optim.AdamW(
        param_groups(model, a), lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, foreach=False
    )
    records, evals = [], []
    held = eval_batches(config) if config.evaluation.every else []
    floor = NoiseFloor()
    start = time.perf_counter()
    for step, batch in enumerate(_batches(config), start=1):
        optimizer.zero_grad(set_to_none=True)
        fields: dict[str, Any] = {}
        if isinstance(batch, PackedStep):
            loss, fields = _packed_step(spec, model, batch, device), record_fields(batch)
        else:
            loss = _fixed_step(config, spec, model, batch, step=step, device=device)
        floor.observe({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        fields.update(_clip_and_step(config, model, optimizer, step))
        if cuda:  # the step's kernels are asynchronous: its time ends when they are done
            torch.cuda.synchronize(device)
        record = StepRecord(
            step=step,
            loss=loss,
            seconds=time.perf_counter() - start,
            **{"tokens": config.tokens_per_step, **fields},
        )
        records.append(record)
        if on_step is not None:
            on_step(record)
        if config.evaluation.due(step):
            evals.append(evaluate_reference(config, model, held, step=step, device=device))
            if on_step is not None:
                on_step(evals[-1])
        start = time.perf_counter()
    params = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    peak = {0: torch.cuda.max_memory_allocated(device)} if cuda else {}
    return TrainResult(
        records=tuple(records),
        params=params,
        peak_memory=peak,
        evaluations=tuple(evals),
        noise_only=floor.masks(),
    )


def _clip_and_step(
    config: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> dict[str, Any]:
    """Clip the gradients (when the recipe does), set the step's learning rate and step
    AdamW; the record's fields for them (``grad_norm``, ``lr``)."""
    fields: dict[str, Any] = {}
    if config.adam.clip_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), config.adam.clip_grad_norm, foreach=False
        )
        fields["grad_norm"] = float(norm)
    fields["lr"] = learning_rate(config.optimizer, step)
    for group in optimizer.param_groups:
        group["lr"] = fields["lr"]
    optimizer.step()
    return fields


def param_groups(model: nn.Module, adam: AdamConfig) -> list[dict[str, Any]]:
    """``model``'s parameters as AdamW's groups: decayed, and exempt (``decays``)."""
    decayed: list[nn.Parameter] = []
    exempt: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        (decayed if decays(name, param.ndim, adam.no_decay) else exempt).append(param)
    groups = [{"params": decayed, "weight_decay": adam.weight_decay},
              {"params": exempt, "weight_decay": 0.0}]  # fmt: skip
    return [g for g in groups if g["params"]]


def _batches(config: TrainConfig) -> Iterator[tuple[torch.Tensor, ...] | PackedStep]:
    if not config.batch.packed:
        return step_batches(config)
    check_packed_dropout(config)
    if config.strategy is None:
        raise TrainError(
            "--tokens-per-step packs documents as a strategy's pipelines and micro-batches "
            "take them: give --strategy, also with --reference"
        )
    if config.elastic.enabled:  # the run re-plans its packing: here every document is a row
        from hspmd.train.elastic_lengths import document_rows

        return document_rows(config)
    if config.switching.length_plans is not None:
        return planned_steps(config)
    return packed_steps(config, config.strategy)


def _fixed_step(
    config: TrainConfig, spec: ModelSpec, model: nn.Module,
    batch: tuple[torch.Tensor, ...], *, step: int, device: torch.device,
) -> float:  # fmt: skip
    """One step of fixed batches on this process, once per accumulation pass (the
    gradients add up): the mean token (item) loss of the step, backpropagated."""
    loss = 0.0
    for k, part in enumerate(accumulation_passes(batch, config)):
        inputs = tuple(t.to(device) for t in part)  # tokens, targets; or fields
        # dropout by position: the pass's rows of the step (DESIGN decision 17)
        rows = range(k * config.batch.global_batch, (k + 1) * config.batch.global_batch)
        with positional_dropout(seed=config.seed, step=step, rows=rows):
            # mean over every token (item) of the global batch, over the passes
            value = step_loss(spec, model, *inputs) / config.batch.grad_accum
        value.backward()
        loss += float(value.detach())
    return loss


def _packed_step(
    spec: ModelSpec, model: nn.Module, step: PackedStep, device: torch.device
) -> float:
    """Every micro-batch of every pipeline, as the strategy packs them, on this process:
    the same weighted sum of mean token losses (backpropagated) as the distributed run."""
    total = 0.0
    for p, pipe in enumerate(step.micro_batches):
        for m, mb in enumerate(pipe):
            if mb.real_tokens == 0:  # an empty micro-batch (length plans): skipped
                continue
            tokens, targets, segments = (t.to(device) for t in (mb.tokens, mb.targets, mb.segments))
            loss = step_loss(spec, model, tokens, targets, segments) * step.scale(p, m)
            loss.backward()
            total += float(loss.detach())
    return total
