"""What a training run is: a typed, frozen config in sections (``hspmd.train.sections``),
and the per-step record it produces.

>>> from hspmd.plan.strategy import parse_strategy
>>> strategy = parse_strategy("2x2: R0:L0-3; 2x2: R1:L0-3")
>>> config = TrainConfig(strategy=strategy, batch=BatchConfig(global_batch=8), steps=2)
>>> config.tokens_per_step, config.batch.seq_len
(512, 64)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from hspmd.data.source import DataSpec
from hspmd.models.llama import get_config
from hspmd.models.spec import BatchField, ModelSpec
from hspmd.plan.strategy import Strategy, StrategyOptions
from hspmd.train.sections import (
    SECTIONS,
    AdamConfig,
    BatchConfig,
    CheckpointConfig,
    Device,
    ElasticConfig,
    EvalConfig,
    FaultConfig,
    LengthPlans,
    LrSchedule,
    ModelChoice,
    RuntimeConfig,
    SwitchAlgo,
    SwitchingConfig,
    SwitchMode,
    TrainError,
    routed,
)

__all__ = [
    "SECTIONS", "AdamConfig", "BatchConfig", "CheckpointConfig", "DataSpec", "Device",
    "ElasticConfig", "EvalConfig", "EvalRecord", "FaultConfig", "LengthPlans", "LrSchedule",
    "ModelChoice", "Record", "RuntimeConfig", "StepRecord", "SwitchAlgo", "SwitchMode",
    "SwitchingConfig", "TrainConfig", "TrainError", "routed",
]  # fmt: skip


def dataset_items(source: str | None) -> tuple[str, tuple[BatchField, ...]] | None:
    """The items of the dataset ``source`` (``--dataset``) as a model's inputs: their
    structure and fields (``hspmd.data.items``); None without a dataset."""
    if source is None:
        return None
    from hspmd.data.items import open_dataset

    layout = open_dataset(source).layout
    return layout.structure, tuple(BatchField(f.name, f.shape, f.dtype) for f in layout.fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """One training run: ``strategy`` (None: one rank), the last step ``steps``, the
    ``seed`` of weights and data order, and the sections (``hspmd.train.sections``), each
    checking its own fields; what spans sections is checked here. Built from flat names
    (``hspmd.fit``'s keywords) by ``hspmd.train.api.train_config`` and ``revise``."""

    model: ModelChoice = field(default_factory=ModelChoice)
    strategy: Strategy | None = None  # e.g. parse_strategy("2x2: R0-1:L0-1 R2:L2-3; 4x1: R3:L0-3")
    steps: int = 5
    seed: int = 0
    batch: BatchConfig = field(default_factory=BatchConfig)
    adam: AdamConfig = field(default_factory=AdamConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation
    data: DataSpec = field(default_factory=DataSpec)  # None path: the stdlib sources
    # the options every strategy of the run runs with: the ZeRO stage (docs/zero.md) and its
    # shares, sequence parallelism, recompute, the pipeline schedule, the compute dtype
    options: StrategyOptions = field(default_factory=StrategyOptions)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    switching: SwitchingConfig = field(default_factory=SwitchingConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise TrainError(f"steps={self.steps} must be at least 1")
        if self.options.recompute_layers and not self.options.recompute:
            raise TrainError(
                f"--recompute-layers {self.options.recompute_layers}: give a count of at "
                "least 0, with --recompute (0: every layer of a stage)"
            )
        self._check_recipe()
        self._check_dataset()
        self._check_elastic()
        if self.batch.packed and self.switching.switches and self.switching.length_plans is None:
            raise TrainError(
                "--switch with --tokens-per-step is not supported yet: train variable-length "
                "steps under one strategy"
            )
        if self.switching.mode == "weights" and self.zero:
            raise TrainError(
                f"--zero {self.zero} adds nothing under switch mode 'weights': its home layout "
                "already shards the fp32 masters and Adam states over all ranks of the run; "
                "drop --zero, or use --switch-mode states to shard them over replicas"
            )
        self._packed_documents()
        # the model is not loaded here: a config is a value (check_model loads it, once)

    def _check_recipe(self) -> None:
        adam = self.adam
        if adam.decaying and adam.decay_steps is None and self.steps <= adam.warmup_steps:
            raise TrainError(
                f"--warmup-steps {adam.warmup_steps} is not below --steps {self.steps}: "
                f"the {adam.lr_schedule} decay (to --decay-steps, default --steps) needs "
                "steps after the warm-up; lower --warmup-steps or give --decay-steps"
            )
        if self.evaluation.every and self.batch.packed:
            raise TrainError(
                f"--eval-every {self.evaluation.every} with --tokens-per-step: evaluation "
                "reads fixed batches of --global-batch x --seq-len, which packed steps do "
                "not have; drop --eval-every or train fixed batches"
            )

    def _check_dataset(self) -> None:
        """What a run on a user's dataset does not take (each one line with the fix; the
        data flags it does not take: ``DataSpec``)."""
        if self.data.dataset is None:
            return
        if not self.model.user_module:
            raise TrainError(
                f"--dataset trains a model on its items: give --model FILE.py:FACTORY (a "
                f"forward that takes the items' fields), not the preset {self.model.source!r}"
            )
        refused = [
            ("--tokens-per-step", self.batch.packed),
            ("--eval-every", self.evaluation.every > 0),
            ("--sequence-parallel", self.options.sequence_parallel),
            ("a context-parallel stage", self.strategy is not None and any(
                st.cp > 1 for strategy in self.strategies for _, _, st in strategy.stages())),
        ]  # fmt: skip
        for what, given in refused:
            if given:
                raise TrainError(
                    f"--dataset {self.data.dataset} does not combine with {what} (token data "
                    f"and sequences only): drop {what}"
                )

    def _check_elastic(self) -> None:
        """What an elastic run does not take, and the faults a run without it injects."""
        if not self.elastic.enabled:
            inject = self.faults.inject
            other = [str(i) for i in inject if i.phase != "forward" or i.mode != "kill"]
            if other:
                raise TrainError(
                    f"--inject-failure {other[0]}: without --elastic only a kill in forward "
                    "(RANK@STEP) is injected (it ends the run); add --elastic"
                )
            return
        switching = self.switching
        refused = [
            ("--zero", self.zero1, "a sharded optimizer state has one holder"),
            (
                "--switch",
                bool(switching.switches),
                "its re-plans choose the strategies; a fixed schedule may name dead ranks",
            ),
            ("--switch-mode weights", switching.mode == "weights", "use states"),
            ("--switch-algo relay", switching.algo == "relay", "use fused"),
        ]
        for flag, given, why in refused:
            if given:
                raise TrainError(f"--elastic does not take {flag} ({why}): drop {flag}")

    def _packed_documents(self) -> None:
        """Packed elastic steps: a document a rank at least, so that every strategy a re-plan
        may give (a pipeline has a rank at least) takes every step
        (``hspmd.train.elastic_lengths``)."""
        given = [self.strategy] if self.strategy is not None else []
        if self.switching.length_plans is not None:
            given += [p.strategy for p in self.switching.length_plans.plans]
        if not self.elastic.enabled or not self.batch.packed or not given:
            return
        ranks = 1 + max(r for strategy in given for r in strategy.ranks)
        least = max(self.batch.min_documents, ranks + self.elastic.spares)
        object.__setattr__(self, "batch", replace(self.batch, min_documents=least))

    def check_model(self) -> ModelSpec:
        """The model's metadata (``model_config``: a preset's config, or the user's module
        built on the meta device, which runs its file), checked against the run. Called at
        the edges (the CLI, ``train_config``, ``check_config``, ``run_reference``), never
        when a config is built."""
        model = self.model_config()
        if model.config_only:
            raise TrainError(
                f"model {self.model.source!r} is metadata-only (too big to train here): "
                "use llama-tiny or llama-small, or `hspmd explain` for this one"
            )
        seq_len = self.batch.seq_len
        if seq_len > model.max_seq_len:
            flag = "--seq-len" if self.batch.step_tokens is None else "--max-seq-len"
            raise TrainError(
                f"seq_len={seq_len} exceeds the model's max_seq_len={model.max_seq_len} (its "
                f"longest position): give {flag} {model.max_seq_len} or less, or a model "
                "with more positions"
            )
        staged = self.strategy is not None and _staged(self.strategies)
        if model.tied and self.zero1 and staged:
            zero = f"--zero {self.options.zero}"
            raise TrainError(
                f"{model.name} ties {model.tied[0][0]} between its first and last stage, which "
                f"{zero} does not shard yet: drop {zero}, or put each pipeline on one stage"
            )
        return model

    @property
    def zero1(self) -> bool:
        """Whether the fp32 masters and Adam states are sharded (ZeRO 1, 2 or 3)."""
        return self.options.zero1

    @property
    def zero(self) -> int:
        """The ZeRO stage (``options.zero``)."""
        return self.options.zero

    def dataset_items(self) -> tuple[str, tuple[BatchField, ...]] | None:
        """The items of ``data.dataset`` as the model's inputs: their structure and fields."""
        return dataset_items(self.data.dataset)

    @property
    def optimizer(self) -> AdamConfig:
        """``adam`` with ``decay_steps`` resolved (None: the run's ``steps``): what every
        optimizer of the run and the reference step with."""
        if self.adam.decay_steps is not None:
            return self.adam
        return replace(self.adam, decay_steps=self.steps)

    def recipe_identity(self) -> dict[str, Any]:
        """The optimizer recipe by ``hspmd train`` flag (checkpoints: a resume that differs
        is warned about)."""
        return {**self.optimizer.identity(), "--grad-accum": self.batch.grad_accum}

    def model_config(self) -> ModelSpec:
        """The model as metadata: a Llama preset's config, or a user module read on the
        meta device (``hspmd.models.module.load_model``), its graph captured in the run's
        compute dtype."""
        model = self.model
        if model.user_module:
            from hspmd.models.module import load_model

            return load_model(model.source, dict(model.overrides), tp_rules=model.tp_rules,
                              items=self.dataset_items(), packed=self.batch.packed,
                              dtype=self.options.dtype)  # fmt: skip
        return get_config(model.source, **dict(model.overrides))

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step: ``global_batch * seq_len * grad_accum``, or at most
        ``step_tokens``."""
        batch = self.batch
        if self.data.dataset is not None:  # items, not tokens
            return batch.global_batch * batch.grad_accum
        return batch.step_tokens or batch.global_batch * batch.seq_len * batch.grad_accum

    def data_identity(self) -> dict[str, Any]:
        """What decides the data stream and the steps' samples, by ``hspmd train`` flag;
        saved in checkpoints so that a resume that differs is warned about."""
        data, batch = self.data, self.batch
        return {
            "--data": data.path or "(the Python standard library sources)",
            **({"--dataset": data.dataset} if data.dataset is not None else {}),
            "--data-max-bytes": data.max_bytes,
            "--data-dtype": data.dtype,
            "--eod-id": data.eod_id,
            "--tokenizer": data.tokenizer,
            "--global-batch": batch.global_batch,
            "--seq-len": batch.seq_len,  # the maximum length with --tokens-per-step
            "--seed": self.seed,
            "--tokens-per-step": batch.step_tokens,
            "--long-docs": batch.long_docs,
            "--eval-split": self.evaluation.split,  # its part is never trained on
        }

    def require_strategy(self) -> Strategy:
        """The starting strategy; a config without one can only train the reference."""
        if self.strategy is None:
            raise TrainError(
                "this run needs a strategy: give TrainConfig(strategy=...) (--strategy), "
                "or train the single-device reference"
            )
        return self.strategy

    @property
    def strategies(self) -> tuple[Strategy, ...]:
        """Every strategy of the run, the starting one first (under length plans every
        strategy of the plans file: the run chooses among them step by step)."""
        start = self.require_strategy()
        plans = self.switching.length_plans
        if plans is not None:
            found = dict.fromkeys(p.strategy for p in plans.plans)
            return (start, *(s for s in found if s != start))
        return (start, *(strategy for _, strategy in self.switching.switches))

    def strategy_at(self, step: int) -> Strategy:
        """The strategy that runs ``step`` (after the switches before it)."""
        start = self.require_strategy()
        return next((t for s, t in reversed(self.switching.switches) if s <= step), start)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One optimizer step as reported: the global mean token loss and timing."""

    step: int  # 1-based
    loss: float
    tokens: int
    seconds: float
    switch_seconds: float | None = None  # a switch ran before this step (slowest rank)
    strategy: str | None = None  # the strategy switched to, with switch_seconds
    switch_messages: int | None = None  # messages the switch sent, summed over ranks
    # variable-length steps: documents and real tokens per pipeline, long documents cut
    sequences: tuple[int, ...] | None = None
    pipeline_tokens: tuple[int, ...] | None = None
    truncated: int | None = None
    dropped: int | None = None
    plan: int | None = None  # with --plans: the strategy chosen for this step
    predicted_seconds: float | None = None  # and its predicted step time
    lr: float | None = None  # the step's learning rate (hspmd.train.lr)
    grad_norm: float | None = None  # with --clip-grad-norm: the global norm before clipping

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step,
            "loss": self.loss,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 6),
        }
        if self.switch_seconds is not None:
            out["switch_seconds"] = round(self.switch_seconds, 6)
            out["switch_messages"] = self.switch_messages
        if self.strategy is not None:  # after a switch; every step of an elastic packed run
            out["strategy"] = self.strategy
        if self.sequences is not None:
            out["sequences"] = list(self.sequences)
            out["pipeline_tokens"] = list(self.pipeline_tokens or ())
            out["truncated"], out["dropped"] = self.truncated, self.dropped
        if self.plan is not None:
            out["plan"], out["predicted_seconds"] = self.plan, self.predicted_seconds
        if self.lr is not None:
            out["lr"] = self.lr
        if self.grad_norm is not None:
            out["grad_norm"] = self.grad_norm
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalRecord:
    """One held-out evaluation as reported: after ``step``, the mean token loss over
    ``batches`` global batches (``tokens`` tokens) and its perplexity.

    >>> EvalRecord(step=4, loss=2.0, batches=2, tokens=128, seconds=0.5).to_json()["eval"]
    {'loss': 2.0, 'perplexity': 7.38905609893065, 'batches': 2, 'tokens': 128, 'seconds': 0.5}
    """

    step: int
    loss: float
    batches: int
    tokens: int
    seconds: float

    @property
    def perplexity(self) -> float:
        """``exp(loss)`` (inf past float's range)."""
        return math.exp(self.loss) if self.loss < 709 else math.inf

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "eval": {
            "loss": self.loss, "perplexity": self.perplexity, "batches": self.batches,
            "tokens": self.tokens, "seconds": round(self.seconds, 6),
        }}  # fmt: skip


Record = StepRecord | EvalRecord
"""What a run reports as it goes: each step, and each evaluation after its step."""


def _staged(strategies: tuple[Strategy, ...]) -> bool:
    """True if a pipeline of one of ``strategies`` has more than one stage."""
    return any(len(pipeline.stages) > 1 for s in strategies for pipeline in s.pipelines)
