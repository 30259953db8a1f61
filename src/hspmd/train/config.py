"""What a training run is: a typed, frozen config, and the per-step record it produces.

>>> from hspmd.plan.strategy import parse_strategy
>>> strategy = parse_strategy("2x2: R0:L0-3; 2x2: R1:L0-3")
>>> config = TrainConfig(strategy=strategy, global_batch=8, steps=2)
>>> config.tokens_per_step
512
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from hspmd.data.source import DataSpec
from hspmd.data.tokens import TOKEN_DTYPES
from hspmd.errors import HspmdError
from hspmd.models.llama import get_config
from hspmd.models.spec import BatchField, ModelSpec, ModuleModel
from hspmd.plan.strategy import Strategy, StrategyOptions
from hspmd.planner.length_model import LengthStrategy
from hspmd.train.faults import Injection

__all__ = [
    "AdamConfig", "Device", "EvalConfig", "EvalRecord", "LengthPlans", "LrSchedule", "SECTIONS", "Record", "StepRecord",
    "SwitchAlgo", "SwitchMode", "TrainConfig", "TrainError",
]  # fmt: skip

SwitchMode = Literal["states", "weights"]
LrSchedule = Literal["constant", "cosine", "linear"]
SwitchAlgo = Literal["fused", "relay"]
Device = Literal["auto", "cpu", "cuda"]


class TrainError(HspmdError, ValueError):
    """A training run that cannot start as configured (sizes, data, options)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdamConfig:
    """AdamW hyperparameters and the learning-rate schedule (docs/recipe.md); the defaults
    are the paper's Adam (Table 6): no weight decay, a constant learning rate.

    ``weight_decay`` is decoupled (AdamW: ``p *= 1 - lr * weight_decay`` before the Adam
    update), applied to the parameters ``hspmd.train.optim.decays`` names: by default those
    of two or more dims (biases and norm weights exempt, as nanoGPT does); ``no_decay``
    (name patterns, ``fnmatch``) replaces that rule. The learning rate of each step is
    ``hspmd.train.lr.learning_rate(config, step)``, a pure function of the step.
    """

    lr: float = 1e-4  # the peak learning rate (after warm-up)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    # exempt from weight decay: parameters matching any pattern; None: those of ndim < 2
    no_decay: tuple[str, ...] | None = None
    lr_schedule: LrSchedule = "constant"
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps to lr over these steps
    decay_steps: int | None = None  # the step the decay reaches min_lr (None: the run's steps)
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr >= 0:  # also NaN
            raise TrainError(f"--lr {self.lr}: give a learning rate of at least 0, e.g. 1e-4")
        for name, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0 <= value < 1:
                raise TrainError(
                    f"--betas: {name}={value} must be in [0, 1), e.g. --betas 0.9,0.95"
                )
        if not self.eps >= 0:
            raise TrainError(f"--eps {self.eps}: give a small positive number, e.g. 1e-8")
        if not 0 <= self.weight_decay < float("inf"):
            raise TrainError(
                f"--weight-decay {self.weight_decay}: give a finite number >= 0, e.g. 0.1"
            )
        if self.lr_schedule not in get_args(LrSchedule):
            raise TrainError(
                f"--lr-schedule {self.lr_schedule!r}: choose one of "
                f"{', '.join(get_args(LrSchedule))}"
            )
        if self.warmup_steps < 0:
            raise TrainError(f"--warmup-steps {self.warmup_steps}: give a count of at least 0")
        if not 0 <= self.min_lr <= self.lr:
            raise TrainError(
                f"--min-lr {self.min_lr}: give a learning rate between 0 and --lr {self.lr}"
            )
        if self.decay_steps is not None and self.decaying and self.decay_steps <= self.warmup_steps:
            raise TrainError(
                f"--decay-steps {self.decay_steps} is not past --warmup-steps "
                f"{self.warmup_steps}: the {self.lr_schedule} decay needs steps after the "
                "warm-up; raise --decay-steps (default: --steps) or lower --warmup-steps"
            )

    @property
    def decaying(self) -> bool:
        """The schedule decays after the warm-up (cosine, linear)."""
        return self.lr_schedule != "constant"

    def identity(self) -> dict[str, Any]:
        """The recipe by ``hspmd train`` flag; saved in checkpoints so that a resume with
        another recipe is warned about. A constant schedule has no decay to compare."""
        decay = (
            {"--decay-steps": self.decay_steps, "--min-lr": self.min_lr} if self.decaying else {}
        )
        return {
            "--lr": self.lr, "--betas": [self.beta1, self.beta2], "--eps": self.eps,
            "--weight-decay": self.weight_decay,
            "--no-decay": None if self.no_decay is None else list(self.no_decay),
            "--lr-schedule": self.lr_schedule, "--warmup-steps": self.warmup_steps, **decay,
        }  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalConfig:
    """A held-out evaluation after every ``every``-th step (0: none; docs/recipe.md): the
    mean token loss over ``batches`` global batches of ``data`` (a corpus read with the
    run's data flags), or of the last ``split`` fraction of the run's corpus, which the
    run then never trains on (``hspmd.data.held_out``)."""

    every: int = 0
    batches: int = 4
    data: str | None = None
    split: float = 0.0

    def __post_init__(self) -> None:
        if self.every < 0 or self.batches < 1:
            raise TrainError(
                f"--eval-every {self.every} --eval-batches {self.batches}: give N >= 0 steps "
                "(0: no evaluation) and K >= 1 batches"
            )
        if not 0 <= self.split < 1:
            raise TrainError(
                f"--eval-split {self.split}: give the fraction of --data to hold out, in [0, 1)"
                ", e.g. 0.01"
            )
        if self.data is not None and self.split:
            raise TrainError(
                f"--eval-data {self.data} and --eval-split {self.split}: evaluate on one of "
                "them; drop --eval-split (the whole of --data trains) or --eval-data"
            )
        if self.every and self.data is None and not self.split:
            raise TrainError(
                f"--eval-every {self.every} needs held-out data: give --eval-split 0.01 (the "
                "last 1% of --data, then never trained on) or --eval-data PATH"
            )

    def due(self, step: int) -> bool:
        """An evaluation follows ``step``."""
        return self.every > 0 and step > 0 and step % self.every == 0


SECTIONS: dict[str, str] = {
    name: "options"
    for name in ("zero", "zero_shares", "sequence_parallel", "recompute", "recompute_layers",
                 "schedule", "dtype")
}  # fmt: skip
"""Flat option names (``hspmd.fit``'s keywords, the CLI's flags) that live in a section of
``TrainConfig``, and the section's field (``TrainConfig.options``: ``StrategyOptions``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthPlans:
    """A plans file of ``hspmd plan --data`` as values (read at the edge: the CLI's
    ``--plans``, ``hspmd.cli.plan_lengths``): its strategies and the predicted seconds of the
    switch between any two (``switch_s[i][j]``: from strategy ``i`` to ``j``)."""

    plans: tuple[LengthStrategy, ...]
    switch_s: tuple[tuple[float, ...], ...]


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
    """One training run. ``strategy`` is the parsed strategy (None: one rank).

    ``global_batch`` counts sequences of ``seq_len`` tokens per optimizer step, summed
    over every pipeline's micro-batches.
    """

    # a preset of hspmd.models.llama.PRESETS, or a factory of any nn.Module:
    # "path/to/file.py:FUNCTION" or "package.module:FUNCTION" (docs/models.md)
    model: str = "llama-tiny"
    # preset fields to override, or the factory's keyword arguments: (("num_layers", 2),)
    model_overrides: tuple[tuple[str, Any], ...] = ()
    # a user module's TP kinds by name pattern, ahead of its own tp_rules (a plan file's
    # per-parameter annotations: hspmd.train.planfile); None: the module's only
    tp_rules: tuple[tuple[str, str], ...] | None = None
    strategy: Strategy | None = None  # e.g. parse_strategy("2x2: R0-1:L0-1 R2:L2-3; 4x1: R3:L0-3")
    global_batch: int = 8
    seq_len: int = 64
    steps: int = 5
    seed: int = 0
    adam: AdamConfig = field(default_factory=AdamConfig)
    # clip the gradients to this global norm before each optimizer step (None: no clipping;
    # inf: measure the norm only); the norm is the single-device one (hspmd.train.clip)
    clip_grad_norm: float | None = None
    evaluation: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation
    # optimizer steps accumulate the gradients of this many global batches (each step then
    # reads grad_accum global batches; the loss is their mean)
    grad_accum: int = 1
    # a text or JSONL file, a directory, or a token file (.bin, .idx, .npy: docs/data.md);
    # None: the stdlib sources
    data: str | None = None
    data_max_bytes: int | None = None  # read at most this much text (None: hspmd.data's default)
    # a user's dataset of any items instead of token data, "FILE.py:FACTORY" (hspmd.data.items:
    # a map-style dataset or an iterable of tensors, tuples or dicts of them; docs/data.md)
    dataset: str | None = None
    data_dtype: str | None = None  # a flat token file's ids: uint16 (None) or uint32
    eod_id: int | None = None  # a token file's end-of-document id (packed steps split there)
    tokenizer: str | None = None  # tokenizer.json or a local HF folder: text is tokenized
    data_cache: str | None = None  # tokenizations' cache (None: $HSPMD_CACHE, ~/.cache/hspmd)
    # the options every strategy of the run runs with: the ZeRO stage (docs/zero.md) and its
    # shares, sequence parallelism, recompute, the pipeline schedule, the compute dtype
    options: StrategyOptions = field(default_factory=StrategyOptions)
    # ZeRO 2 and 3: one gradient bucket in flight while backward goes on, and under ZeRO-3
    # the next unit's gather prefetched; False: each waited at once (the least memory)
    zero_overlap: bool = True
    overlap: bool = True  # gradient sync during the last backward (False: after it)
    bucket_bytes: int = 4 << 20  # flat gradient buckets of Post (hspmd.train.sync)
    # (step, strategy): switch to that strategy in memory before that step (hspmd.switch.live)
    switches: tuple[tuple[int, Strategy], ...] = ()
    # measure each rank's peak training-state bytes (hspmd.train.meter; benchmarks/zero.py)
    measure_memory: bool = False
    # "states": a switch moves fp32 masters and Adam states (unstable devices);
    # "weights": they stay under a fixed home layout, only compute weights move (mixed-length)
    switch_mode: SwitchMode = "states"
    # "fused": one BSR per switch; "relay": its single-owner inter-node transfers relayed
    # over every NIC of both nodes (hspmd.comm.relay), which needs nodes: ``cluster`` (a
    # cluster file or shipped name) or ``ranks_per_node`` (fake nodes of local processes)
    switch_algo: SwitchAlgo = "fused"
    cluster: str | None = None
    ranks_per_node: int | None = None
    save: str | None = None  # checkpoint directory (hspmd.checkpoint)
    save_every: int = 1  # save after every N-th step (with ``save``)
    resume: str | None = None  # continue from the newest checkpoint in this directory
    # (rank, factor): that rank sleeps (factor - 1) x each compute's time (hspmd.train.slowdown)
    slowdown: tuple[tuple[int, float], ...] = ()
    # elastic training (hspmd.train.elastic): survive dead and hung ranks in-process
    elastic: bool = False
    hang_timeout: float = 60.0  # seconds without progress before a rank counts as hung
    inject: tuple[Injection, ...] = ()  # fault injection (hspmd.train.faults)
    spares: int = 0  # local processes held back at the start, for growth
    grow: tuple[tuple[int, int], ...] = ()  # (step, count): that many spares join before it
    # variable-length steps (hspmd.train.packing): whole documents of at most this many
    # tokens per step, packed into the micro-batches; ``seq_len`` is then the maximum length
    step_tokens: int | None = None
    long_docs: str = "truncate"  # a document over seq_len tokens: truncate, drop or error
    # at least this many documents a step (0: one per micro-batch of the strategy): runs
    # of different strategies then see the same steps (benchmarks/mixed_length.py)
    min_documents: int = 0
    # a plans file (``hspmd plan --data``): per step the strategy with the least
    # predicted time is chosen (hspmd.train.packing.planned_steps) on a background worker
    # (hspmd.train.plan_ahead); the loop switches when the choice changes
    length_plans: LengthPlans | None = None
    # where the ranks compute (hspmd.train.device): "auto" is CUDA with nccl when torch
    # sees a GPU per rank, else CPU with gloo; "cpu" and "cuda" force one
    device: Device = "auto"

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len", "steps", "save_every", "bucket_bytes",
                     "grad_accum"):  # fmt: skip
            if getattr(self, name) < 1:
                raise TrainError(f"{name}={getattr(self, name)} must be at least 1")
        if self.data_max_bytes is not None and self.data_max_bytes < 1:
            raise TrainError(
                f"--data-max-bytes {self.data_max_bytes}: give a positive size in bytes (leave "
                "it out for the default)"
            )
        self._check_data()
        self._check_dataset()
        steps = [step for step, _ in self.switches]
        if steps != sorted(set(steps)) or (steps and steps[0] < 2):
            raise TrainError(
                f"switch steps {steps}: give each step once, in increasing order, from 2 on "
                "(the strategy of step 1 is --strategy)"
            )
        if self.options.recompute_layers and not self.options.recompute:
            raise TrainError(
                f"--recompute-layers {self.options.recompute_layers}: give a count of at "
                "least 0, with --recompute (0: every layer of a stage)"
            )
        self._check_recipe()
        self._check_slowdown()
        self._check_elastic()
        self._check_packed()
        # the Literal types check callers under mypy; these check everyone else
        for name, kind in (("switch_mode", SwitchMode), ("switch_algo", SwitchAlgo),
                           ("device", Device)):  # fmt: skip
            if getattr(self, name) not in get_args(kind):
                raise TrainError(
                    f"{name}={getattr(self, name)!r}: choose one of {', '.join(get_args(kind))}"
                )
        if self.switch_algo == "relay" and not (self.cluster or self.ranks_per_node):
            raise TrainError(
                "switch algorithm 'relay' needs nodes to relay through: give --cluster "
                "FILE_OR_NAME or --ranks-per-node N"
            )
        if self.switch_algo == "relay" and self.switch_mode == "weights":
            raise TrainError(
                "switch algorithm 'relay' runs the states mode's switch only: use "
                "--switch-mode states or --switch-algo fused"
            )
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise TrainError(f"ranks_per_node={self.ranks_per_node} must be at least 1")
        self._check_zero()
        # the model is not loaded here: a config is a value (check_model loads it, once)

    def check_model(self) -> ModelSpec:
        """The model's metadata (``model_config``: a preset's config, or the user's module
        built on the meta device, which runs its file), checked against the run. Called at
        the edges (the CLI, ``train_config``, ``check_config``, ``run_reference``), never
        when a config is built."""
        model = self.model_config()
        if model.config_only:
            raise TrainError(
                f"model {self.model!r} is metadata-only (too big to train here): "
                "use llama-tiny or llama-small, or `hspmd explain` for this one"
            )
        if self.seq_len > model.max_seq_len:
            raise TrainError(
                f"seq_len={self.seq_len} exceeds the model's max_seq_len={model.max_seq_len}"
            )
        if isinstance(model, ModuleModel):
            self._check_module(model)
        return model

    @property
    def zero1(self) -> bool:
        """Whether the fp32 masters and Adam states are sharded (ZeRO 1, 2 or 3)."""
        return self.options.zero1

    @property
    def zero(self) -> int:
        """The ZeRO stage (``options.zero``)."""
        return self.options.zero

    def _check_zero(self) -> None:
        """What the ZeRO stage does not combine with (docs/zero.md; ``StrategyOptions``
        checks the stage and the shares)."""
        if self.switch_mode == "weights" and self.zero:
            raise TrainError(
                f"--zero {self.zero} adds nothing under switch mode 'weights': its home layout "
                "already shards the fp32 masters and Adam states over all ranks of the run; "
                "drop --zero, or use --switch-mode states to shard them over replicas"
            )

    def _check_module(self, model: ModuleModel) -> None:
        """What a user module's run cannot do yet (each one line with the fix)."""
        if model.tied and self.zero1 and self.strategy is not None and _staged(self.strategies):
            raise TrainError(
                f"{model.name} ties {model.tied[0][0]} between its first and last stage, which "
                "--zero1 does not shard yet: drop --zero1, or put each pipeline on one stage"
            )

    def _check_elastic(self) -> None:
        if not self.hang_timeout > 0:
            raise TrainError(f"hang_timeout={self.hang_timeout}: give a positive number of seconds")
        if self.spares < 0:
            raise TrainError(f"--spares {self.spares}: give a count of at least 0")
        if (self.spares or self.grow) and not self.elastic:
            raise TrainError("--spares and --grow are for elastic runs: add --elastic")
        steps = [step for step, _ in self.grow]
        if steps != sorted(set(steps)) or any(s < 2 or n < 1 for s, n in self.grow):
            raise TrainError(
                f"--grow {self.grow}: give STEP=COUNT once per step, steps from 2 on, "
                "COUNT >= 1, e.g. --grow 3=2"
            )
        if sum(n for _, n in self.grow) > self.spares:
            raise TrainError(
                f"--grow adds {sum(n for _, n in self.grow)} ranks but --spares is "
                f"{self.spares}: hold back enough spares (--spares N)"
            )
        if not self.elastic:
            other = [str(i) for i in self.inject if i.phase != "forward" or i.mode != "kill"]
            if other:
                raise TrainError(
                    f"--inject-failure {other[0]}: without --elastic only a kill in forward "
                    "(RANK@STEP) is injected (it ends the run); add --elastic"
                )
            return
        refused = [
            ("--zero", self.zero1, "a sharded optimizer state has one holder"),
            (
                "--switch",
                bool(self.switches),
                "its re-plans choose the strategies; a fixed schedule may name dead ranks",
            ),
            ("--switch-mode weights", self.switch_mode == "weights", "use states"),
            ("--switch-algo relay", self.switch_algo == "relay", "use fused"),
        ]
        for flag, given, why in refused:
            if given:
                raise TrainError(f"--elastic does not take {flag} ({why}): drop {flag}")
        self._packed_documents()

    def _packed_documents(self) -> None:
        """Packed elastic steps: a document a rank at least, so that every strategy a re-plan
        may give (a pipeline has a rank at least) takes every step
        (``hspmd.train.elastic_lengths``)."""
        given = [self.strategy] if self.strategy is not None else []
        if self.length_plans is not None:
            given += [p.strategy for p in self.length_plans.plans]
        if self.step_tokens is None or not given:
            return
        ranks = 1 + max(r for strategy in given for r in strategy.ranks)
        object.__setattr__(self, "min_documents", max(self.min_documents, ranks + self.spares))

    def _check_data(self) -> None:
        if self.data_dtype is not None and self.data_dtype not in TOKEN_DTYPES:
            raise TrainError(
                f"--data-dtype {self.data_dtype}: choose one of {', '.join(TOKEN_DTYPES)}"
            )
        if self.eod_id is not None and self.eod_id < 0:
            raise TrainError(f"--eod-id {self.eod_id}: give a token id (>= 0)")

    def _check_dataset(self) -> None:
        """What a run on a user's dataset does not take (each one line with the fix)."""
        if self.dataset is None:
            return
        if not self.module_model:
            raise TrainError(
                f"--dataset trains a model on its items: give --model FILE.py:FACTORY (a "
                f"forward that takes the items' fields), not the preset {self.model!r}"
            )
        refused = [
            ("--data", self.data is not None), ("--tokenizer", self.tokenizer is not None),
            ("--tokens-per-step", self.step_tokens is not None),
            ("--eval-every", self.evaluation.every > 0),
            ("--sequence-parallel", self.options.sequence_parallel),
            ("a context-parallel stage", self.strategy is not None and any(
                st.cp > 1 for strategy in self.strategies for _, _, st in strategy.stages())),
        ]  # fmt: skip
        for what, given in refused:
            if given:
                raise TrainError(
                    f"--dataset {self.dataset} does not combine with {what} (token data and "
                    f"sequences only): drop {what}"
                )

    def dataset_items(self) -> tuple[str, tuple[BatchField, ...]] | None:
        """The items of ``dataset`` as the model's inputs: their structure and fields."""
        return dataset_items(self.dataset)

    @property
    def data_spec(self) -> DataSpec:
        """The data flags as one value (``hspmd.data.source``); reads nothing."""
        return DataSpec(
            path=self.data, dtype=self.data_dtype, eod_id=self.eod_id, tokenizer=self.tokenizer,
            cache=self.data_cache, max_bytes=self.data_max_bytes,
        )  # fmt: skip

    def _check_recipe(self) -> None:
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise TrainError(
                f"--clip-grad-norm {self.clip_grad_norm}: give a positive norm, e.g. 1.0 "
                "(inf measures the norm without clipping)"
            )
        if (
            self.adam.decaying
            and self.adam.decay_steps is None
            and self.steps <= self.adam.warmup_steps
        ):
            raise TrainError(
                f"--warmup-steps {self.adam.warmup_steps} is not below --steps {self.steps}: "
                f"the {self.adam.lr_schedule} decay (to --decay-steps, default --steps) needs "
                "steps after the warm-up; lower --warmup-steps or give --decay-steps"
            )
        if self.evaluation.every and self.step_tokens is not None:
            raise TrainError(
                f"--eval-every {self.evaluation.every} with --tokens-per-step: evaluation "
                "reads fixed batches of --global-batch x --seq-len, which packed steps do "
                "not have; drop --eval-every or train fixed batches"
            )
        if self.grad_accum > 1 and self.step_tokens is not None:
            raise TrainError(
                f"--grad-accum {self.grad_accum} with --tokens-per-step: packed steps weigh "
                "their documents within one step; drop --grad-accum or raise --tokens-per-step"
            )

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
        return {
            **self.optimizer.identity(),
            "--clip-grad-norm": self.clip_grad_norm,
            "--grad-accum": self.grad_accum,
        }

    def _check_slowdown(self) -> None:
        ranks = [rank for rank, _ in self.slowdown]
        if len(set(ranks)) != len(ranks):
            raise TrainError(
                f"slowdown {self.slowdown}: rank listed twice; give each rank once, e.g. 2=3,5=3"
            )
        for rank, factor in self.slowdown:
            if rank < 0:
                raise TrainError(f"slowdown rank {rank} must be >= 0 (a rank of the strategy)")
            if not factor >= 1.0 or factor == float("inf"):
                raise TrainError(
                    f"slowdown factor {factor} of rank {rank} must be a finite number >= 1 "
                    "(3 makes the rank three times slower; 1 leaves it as is)"
                )

    def _check_packed(self) -> None:
        if self.long_docs not in ("truncate", "drop", "error"):
            raise TrainError(f"long_docs={self.long_docs!r}: choose truncate, drop or error")
        if self.step_tokens is None:
            return
        if self.step_tokens < self.seq_len:
            raise TrainError(
                f"--tokens-per-step {self.step_tokens} is below --max-seq-len {self.seq_len}: "
                "a step must hold a document of the maximum length; raise it"
            )
        if self.switches and self.length_plans is None:
            raise TrainError(
                "--switch with --tokens-per-step is not supported yet: train variable-length "
                "steps under one strategy"
            )

    @property
    def module_model(self) -> bool:
        """``model`` names a user module's factory (``FILE.py:FUNCTION``), not a preset."""
        return ":" in self.model

    @property
    def packed(self) -> bool:
        """Variable-length steps of packed documents (``step_tokens``), not fixed batches."""
        return self.step_tokens is not None

    def model_config(self) -> ModelSpec:
        """The model as metadata: a Llama preset's config, or a user module read on the
        meta device (``hspmd.models.module.load_model``)."""
        if self.module_model:
            from hspmd.models.module import load_model

            return load_model(self.model, dict(self.model_overrides), tp_rules=self.tp_rules,
                              items=self.dataset_items(),
                              packed=self.step_tokens is not None)  # fmt: skip
        return get_config(self.model, **dict(self.model_overrides))

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step: ``global_batch * seq_len * grad_accum``, or at most
        ``step_tokens``."""
        if self.dataset is not None:  # items, not tokens
            return self.global_batch * self.grad_accum
        return self.step_tokens or self.global_batch * self.seq_len * self.grad_accum

    def data_identity(self) -> dict[str, Any]:
        """What decides the data stream and the steps' samples, by ``hspmd train`` flag;
        saved in checkpoints so that a resume that differs is warned about."""
        return {
            "--data": self.data or "(the Python standard library sources)",
            **({"--dataset": self.dataset} if self.dataset is not None else {}),
            "--data-max-bytes": self.data_max_bytes,
            "--data-dtype": self.data_dtype,
            "--eod-id": self.eod_id,
            "--tokenizer": self.tokenizer,
            "--global-batch": self.global_batch,
            "--seq-len": self.seq_len,  # the maximum length with --tokens-per-step
            "--seed": self.seed,
            "--tokens-per-step": self.step_tokens,
            "--long-docs": self.long_docs,
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
        if self.length_plans is not None:
            found = dict.fromkeys(p.strategy for p in self.length_plans.plans)
            return (start, *(s for s in found if s != start))
        return (start, *(strategy for _, strategy in self.switches))

    def strategy_at(self, step: int) -> Strategy:
        """The strategy that runs ``step`` (after the switches before it)."""
        start = self.require_strategy()
        return next((t for s, t in reversed(self.switches) if s <= step), start)


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
