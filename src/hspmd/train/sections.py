"""The sections of a run's config (``hspmd.train.config.TrainConfig``): kw-only frozen values
named for what they hold, each checking its own fields with one line that names the value
and the fix. What needs two sections at once is checked by ``TrainConfig``.

=====================  ==================================================================
section                holds
=====================  ==================================================================
``model``              ``ModelChoice``: the model's source, its overrides, TP rules
``batch``              ``BatchConfig``: a step's sequences, their length, accumulation,
                       packed variable-length steps
``adam``               ``AdamConfig``: the optimizer's recipe, gradient clipping
``evaluation``         ``EvalConfig``: held-out evaluation
``data``               ``DataSpec`` (``hspmd.data.source``): the corpus or dataset
``options``            ``StrategyOptions`` (``hspmd.plan.strategy``): ZeRO, SP, recompute..
``runtime``            ``RuntimeConfig``: gradient sync overlap, buckets, device, meter
``switching``          ``SwitchingConfig``: planned switches, their mode and algorithm
``elastic``            ``ElasticConfig``: dead and hung ranks survived, spares, growth
``faults``             ``FaultConfig``: fault injection, slowdown emulation
``checkpoint``         ``CheckpointConfig``: save, how often, resume
=====================  ==================================================================

``SECTIONS`` is the one map from the flat names (``hspmd.fit``'s keywords, ``revise``'s) to
a section's field; ``routed`` applies flat values through it.

>>> SECTIONS["save_every"], SECTIONS["data"]
(('checkpoint', 'every'), ('data', 'path'))
>>> BatchConfig(global_batch=0)
Traceback (most recent call last):
...
hspmd.train.sections.TrainError: global_batch=0 must be at least 1
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar, get_args

from hspmd.data import LONG_DOCS
from hspmd.errors import HspmdError
from hspmd.plan.strategy import Strategy
from hspmd.planner.length_model import LengthStrategy
from hspmd.train.faults import Injection

__all__ = [
    "SECTIONS", "AdamConfig", "BatchConfig", "CheckpointConfig", "Device", "ElasticConfig",
    "EvalConfig", "FaultConfig", "LengthPlans", "LrSchedule", "ModelChoice", "RuntimeConfig",
    "SwitchAlgo", "SwitchMode", "SwitchingConfig", "TrainError", "routed",
]  # fmt: skip

SwitchMode = Literal["states", "weights"]
LrSchedule = Literal["constant", "cosine", "linear"]
SwitchAlgo = Literal["fused", "relay"]
Device = Literal["auto", "cpu", "cuda"]


class TrainError(HspmdError, ValueError):
    """A training run that cannot start as configured (sizes, data, options)."""


def _check_choice(name: str, value: str, kind: Any) -> None:
    """The ``Literal`` types check callers under mypy; this checks everyone else."""
    if value not in get_args(kind):
        raise TrainError(f"{name}={value!r}: choose one of {', '.join(get_args(kind))}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelChoice:
    """Which model a run trains, as text every process can load (``model_config`` loads it).

    ``source``: a preset of ``hspmd.models.llama.PRESETS``, or a factory of any nn.Module,
    ``"path/to/file.py:FUNCTION"`` or ``"package.module:FUNCTION"`` (docs/models.md), or
    ``"hf:DIR"``. ``overrides``: preset fields to override, or the factory's keyword
    arguments (``(("num_layers", 2),)``). ``tp_rules``: a user module's TP kinds by name
    pattern, ahead of its own (a plan file's per-parameter annotations:
    ``hspmd.train.planfile``); None: the module's only.
    """

    source: str = "llama-tiny"
    overrides: tuple[tuple[str, Any], ...] = ()
    tp_rules: tuple[tuple[str, str], ...] | None = None

    @property
    def user_module(self) -> bool:
        """``source`` names a user module's factory (``FILE.py:FUNCTION``), not a preset."""
        return ":" in self.source


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchConfig:
    """What one optimizer step reads. ``global_batch`` counts sequences of ``seq_len``
    tokens, summed over every pipeline's micro-batches; a step accumulates the gradients of
    ``grad_accum`` global batches (the loss is their mean).

    Variable-length steps (``hspmd.train.packing``): whole documents of at most
    ``step_tokens`` tokens a step, packed into the micro-batches; ``seq_len`` is then the
    maximum length, and a longer document is cut, dropped or refused (``long_docs``). At
    least ``min_documents`` documents a step (0: one per micro-batch of the strategy): runs
    of different strategies then see the same steps (benchmarks/mixed_length.py).
    """

    global_batch: int = 8
    seq_len: int = 64
    grad_accum: int = 1
    step_tokens: int | None = None
    long_docs: str = "truncate"
    min_documents: int = 0

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len", "grad_accum"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name}={getattr(self, name)} must be at least 1")
        if self.long_docs not in LONG_DOCS:
            raise TrainError(f"long_docs={self.long_docs!r}: choose truncate, drop or error")
        if self.step_tokens is None:
            return
        if self.step_tokens < self.seq_len:
            raise TrainError(
                f"--tokens-per-step {self.step_tokens} is below --max-seq-len {self.seq_len}: "
                "a step must hold a document of the maximum length; raise it"
            )
        if self.grad_accum > 1:
            raise TrainError(
                f"--grad-accum {self.grad_accum} with --tokens-per-step: packed steps weigh "
                "their documents within one step; drop --grad-accum or raise --tokens-per-step"
            )

    @property
    def packed(self) -> bool:
        """Variable-length steps of packed documents (``step_tokens``), not fixed batches."""
        return self.step_tokens is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class AdamConfig:
    """AdamW hyperparameters, the learning-rate schedule and gradient clipping
    (docs/recipe.md); the defaults are the paper's Adam (Table 6): no weight decay, a
    constant learning rate, no clipping.

    ``weight_decay`` is decoupled (AdamW: ``p *= 1 - lr * weight_decay`` before the Adam
    update), applied to the parameters ``hspmd.train.optim.decays`` names: by default those
    of two or more dims (biases and norm weights exempt, as nanoGPT does); ``no_decay``
    (name patterns, ``fnmatch``) replaces that rule. The learning rate of each step is
    ``hspmd.train.lr.learning_rate(config, step)``, a pure function of the step.
    ``clip_grad_norm``: the gradients are clipped to this global norm before each step
    (None: no clipping; inf: measure the norm only); the norm is the single-device one
    (``hspmd.train.clip``).
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
    clip_grad_norm: float | None = None

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
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise TrainError(
                f"--clip-grad-norm {self.clip_grad_norm}: give a positive norm, e.g. 1.0 "
                "(inf measures the norm without clipping)"
            )
        self._check_schedule()

    def _check_schedule(self) -> None:
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
            "--clip-grad-norm": self.clip_grad_norm,
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


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeConfig:
    """How the ranks run. ``overlap``: gradient sync during the last backward (False: after
    it), in flat buckets of ``bucket_bytes`` (``hspmd.train.sync``). ``zero_overlap``: under
    ZeRO 2 and 3 one gradient bucket in flight while backward goes on, and under ZeRO-3 the
    next unit's gather prefetched (False: each waited at once, the least memory).
    ``device`` (``hspmd.train.device``): "auto" is CUDA with nccl when torch sees a GPU per
    rank, else CPU with gloo; "cpu" and "cuda" force one. ``measure_memory``: each rank's
    peak training-state bytes (``hspmd.train.meter``; benchmarks/zero.py)."""

    overlap: bool = True
    bucket_bytes: int = 4 << 20
    zero_overlap: bool = True
    device: Device = "auto"
    measure_memory: bool = False

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise TrainError(f"bucket_bytes={self.bucket_bytes} must be at least 1")
        _check_choice("device", self.device, Device)


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthPlans:
    """A plans file of ``hspmd plan --data`` as values (read at the edge: the CLI's
    ``--plans``, ``hspmd.cli.plan_lengths``): its strategies and the predicted seconds of the
    switch between any two (``switch_s[i][j]``: from strategy ``i`` to ``j``)."""

    plans: tuple[LengthStrategy, ...]
    switch_s: tuple[tuple[float, ...], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchingConfig:
    """Strategy switches in memory (``hspmd.switch.live``). ``switches``: (step, strategy),
    switch to that strategy before that step. ``mode``: "states" moves fp32 masters and
    Adam states (unstable devices); "weights" keeps them under a fixed home layout and moves
    only compute weights (mixed-length). ``algo``: "fused" is one BSR per switch; "relay"
    relays its single-owner inter-node transfers over every NIC of both nodes
    (``hspmd.comm.relay``), which needs nodes: ``cluster`` (a cluster file or shipped name)
    or ``ranks_per_node`` (fake nodes of local processes). ``length_plans``: a plans file
    (``hspmd plan --data``): per step the strategy with the least predicted time is chosen
    (``hspmd.train.packing.planned_steps``) on a background worker
    (``hspmd.train.plan_ahead``); the loop switches when the choice changes."""

    switches: tuple[tuple[int, Strategy], ...] = ()
    mode: SwitchMode = "states"
    algo: SwitchAlgo = "fused"
    cluster: str | None = None
    ranks_per_node: int | None = None
    length_plans: LengthPlans | None = None

    def __post_init__(self) -> None:
        steps = [step for step, _ in self.switches]
        if steps != sorted(set(steps)) or (steps and steps[0] < 2):
            raise TrainError(
                f"switch steps {steps}: give each step once, in increasing order, from 2 on "
                "(the strategy of step 1 is --strategy)"
            )
        _check_choice("switch_mode", self.mode, SwitchMode)
        _check_choice("switch_algo", self.algo, SwitchAlgo)
        if self.algo == "relay" and not (self.cluster or self.ranks_per_node):
            raise TrainError(
                "switch algorithm 'relay' needs nodes to relay through: give --cluster "
                "FILE_OR_NAME or --ranks-per-node N"
            )
        if self.algo == "relay" and self.mode == "weights":
            raise TrainError(
                "switch algorithm 'relay' runs the states mode's switch only: use "
                "--switch-mode states or --switch-algo fused"
            )
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise TrainError(f"ranks_per_node={self.ranks_per_node} must be at least 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticConfig:
    """Elastic training (``hspmd.train.elastic``): with ``enabled``, dead and hung ranks are
    survived in-process; a rank without progress for ``hang_timeout`` seconds counts as
    hung. ``spares`` local processes are held back at the start; ``grow``: (step, count),
    that many of them join before that step."""

    enabled: bool = False
    hang_timeout: float = 60.0
    spares: int = 0
    grow: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.hang_timeout > 0:
            raise TrainError(f"hang_timeout={self.hang_timeout}: give a positive number of seconds")
        if self.spares < 0:
            raise TrainError(f"--spares {self.spares}: give a count of at least 0")
        if (self.spares or self.grow) and not self.enabled:
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


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultConfig:
    """Faults made on purpose, for tests and experiments: ``inject`` (``hspmd.train.faults``)
    kills or hangs ranks; ``slowdown``: (rank, factor), that rank sleeps (factor - 1) x each
    compute's time (``hspmd.train.slowdown``)."""

    inject: tuple[Injection, ...] = ()
    slowdown: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
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


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints (``hspmd.checkpoint``): into directory ``save`` after every ``every``-th
    step; ``resume``: continue from the newest checkpoint in that directory."""

    save: str | None = None
    every: int = 1
    resume: str | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise TrainError(f"save_every={self.every} must be at least 1")


# The flat names of hspmd.fit's keywords (and revise's), each the (section, field) it sets.
SECTIONS: dict[str, tuple[str, str]] = {
    "model": ("model", "source"), "model_overrides": ("model", "overrides"),
    "tp_rules": ("model", "tp_rules"),
    **{name: ("batch", name) for name in ("global_batch", "seq_len", "grad_accum",
                                          "step_tokens", "long_docs", "min_documents")},
    **{name: ("adam", name) for name in ("lr", "beta1", "beta2", "eps", "weight_decay",
                                         "no_decay", "lr_schedule", "warmup_steps",
                                         "decay_steps", "min_lr", "clip_grad_norm")},
    "data": ("data", "path"), "data_max_bytes": ("data", "max_bytes"),
    "data_dtype": ("data", "dtype"), "data_cache": ("data", "cache"),
    **{name: ("data", name) for name in ("dataset", "eod_id", "tokenizer")},
    **{name: ("options", name) for name in ("zero", "zero_shares", "sequence_parallel",
                                            "recompute", "recompute_layers", "schedule",
                                            "dtype")},
    **{name: ("runtime", name) for name in ("overlap", "bucket_bytes", "zero_overlap",
                                            "device", "measure_memory")},
    "switches": ("switching", "switches"), "switch_mode": ("switching", "mode"),
    "switch_algo": ("switching", "algo"),
    **{name: ("switching", name) for name in ("cluster", "ranks_per_node", "length_plans")},
    "elastic": ("elastic", "enabled"), "hang_timeout": ("elastic", "hang_timeout"),
    "spares": ("elastic", "spares"), "grow": ("elastic", "grow"),
    "inject": ("faults", "inject"), "slowdown": ("faults", "slowdown"),
    "save": ("checkpoint", "save"), "save_every": ("checkpoint", "every"),
    "resume": ("checkpoint", "resume"),
}  # fmt: skip

C = TypeVar("C")


def routed(base: C, flat: Mapping[str, Any]) -> C:
    """``base`` (a ``TrainConfig``) with ``flat``'s values: a name of ``SECTIONS`` into its
    section's field (on the section ``flat`` gives whole, else on ``base``'s), any other
    name as the field of that name. The one place flat names become sections."""
    top = {name: value for name, value in flat.items() if name not in SECTIONS}
    for section in dict.fromkeys(section for section, _ in SECTIONS.values()):
        changes = {
            SECTIONS[n][1]: v for n, v in flat.items() if SECTIONS.get(n, ("",))[0] == section
        }
        if changes:
            top[section] = replace(top.get(section, getattr(base, section)), **changes)
    return replace(base, **top)  # type: ignore[type-var]
