"""The flags of a training run, stated once: name, the ``TrainConfig`` field it sets, type,
default, choices and help.

``hspmd train`` and ``hspmd demo`` add every flag of ``TRAIN_FLAGS``
(``hspmd.cli.train.add_config_arguments``); ``hspmd explain`` and ``hspmd simulate`` add
the strategy options' flags by name (``add_flags``), so the same flag has the same help,
default and choices everywhere. Defaults and choices come from ``TrainConfig`` (its field
defaults and ``Literal`` types) where the flag sets the field as given; a flag whose
default means something else (``--global-batch``: the strategy's sum) says so in its help.
``tests/cli/test_flags.py`` checks that every field of ``TrainConfig`` (and of each of its
sections, as ``adam.<field>``, ``batch.<field>``, ...) has exactly one flag here (or is
named in ``NOT_FLAGS``
with the reason) and that the parsers use these.

>>> FLAGS["--schedule"].choices, FLAGS["--schedule"].default
(('1f1b', 'gpipe'), '1f1b')
>>> FLAGS["--no-overlap"].field, FLAGS["--lr"].default
('runtime.overlap', 0.0001)
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from hspmd.cli.model_input import model_argument
from hspmd.cli.strategy_arg import strategy_argument, switch_argument
from hspmd.data import LONG_DOCS
from hspmd.data.tokens import TOKEN_DTYPES
from hspmd.models.llama import PRESETS
from hspmd.train.config import AdamConfig, EvalConfig, LrSchedule, TrainConfig, TrainError

__all__ = [
    "FLAGS", "NOT_FLAGS", "STRATEGY_FLAGS", "TRAIN_FLAGS", "Flag", "HelpFormatter", "add_flags",
    "shares_of", "zero_of",
]  # fmt: skip


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and ``(default: X)`` after every option that has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if action.help is None or default is None or default is False or default in ([], ""):
            return action.help
        return super()._get_help_string(action)


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag of a training run. ``field``: the ``TrainConfig`` field it sets
    (``adam.lr``: ``AdamConfig``'s; None: it shapes another flag's field)."""

    name: str
    field: str | None
    help: str
    _: KW_ONLY
    type: Callable[[str], object] | None = None
    default: object = None
    choices: tuple[str, ...] | None = None
    action: str | None = None  # "store_true" or "append"
    metavar: str | None = None

    def add(self, parser: argparse._ActionsContainer, **changes: object) -> argparse.Action:
        """Add this flag to ``parser`` (or an argument group); ``changes``: what one command
        sets otherwise (``required=True``, a command's own default)."""
        default = False if self.action == "store_true" else self.default
        options: dict[str, Any] = {"help": self.help, "default": default}
        if self.action is not None:
            options["action"] = self.action
        for key in ("type", "choices", "metavar"):
            if getattr(self, key) is not None:
                options[key] = getattr(self, key)
        options.update(changes)
        return parser.add_argument(self.name, **options)


def _default(name: str) -> object:
    """``TrainConfig``'s default of field ``name`` (``options.dtype``: of a section's)."""
    value: object = _DEFAULT
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _choices(name: str) -> tuple[str, ...]:
    """The values of field ``name``'s ``Literal`` type (``options.dtype``: a section's)."""
    kind: Any = TrainConfig
    for part in name.split("."):
        kind = typing.get_type_hints(kind)[part]
    return typing.get_args(kind)


_DEFAULT = TrainConfig()


# Without --global-batch and --strategy (the reference run): this many sequences per step.
REFERENCE_BATCH = 8
_TRAINABLE = [name for name, c in PRESETS.items() if not c.config_only]

# In `hspmd train --help` order.
TRAIN_FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model.source", type=model_argument(_TRAINABLE),
         default=_default("model.source"),
         help=f"a preset ({', '.join(_TRAINABLE)}), any nn.Module's factory: FILE.py:FUNCTION "
         "or package.module:FUNCTION (docs/models.md), or hf:DIR, a local Hugging Face folder "
         "whose weights training starts from (docs/checkpoints.md)"),
    Flag("--config", "model.overrides",
         help="JSON object (or a .json file): the factory's keyword arguments, or preset "
         """fields to override, e.g. '{"num_layers": 2}'"""),
    Flag("--strategy", "strategy", type=strategy_argument,
         help="pipelines 'COUNTxSIZE: R<ranks>:L<first>-<last> ...' separated by ';', "
         "N*(PIPELINE) for N shifted copies, or @FILE holding the strategy"),
    Flag("--global-batch", "batch.global_batch", type=int,
         help="sequences per step (default: the strategy's sum of COUNT x SIZE; "
         f"{REFERENCE_BATCH} without a strategy)"),
    Flag("--seq-len", "batch.seq_len", type=int, default=_default("batch.seq_len"),
         help="tokens per sequence"),
    Flag("--steps", "steps", type=int, default=_default("steps"),
         help="last step (counts from the start)"),
    Flag("--seed", "seed", type=int, default=_default("seed"),
         help="seed of weights and data order"),
    Flag("--lr", "adam.lr", type=float, default=AdamConfig().lr,
         help="peak learning rate of AdamW (after --warmup-steps; docs/recipe.md)"),
    Flag("--lr-schedule", "adam.lr_schedule", default=AdamConfig().lr_schedule,
         choices=typing.get_args(LrSchedule),
         help="after the warm-up: constant, or cosine / linear decay to --min-lr at --decay-steps"),
    Flag("--warmup-steps", "adam.warmup_steps", type=int, default=AdamConfig().warmup_steps,
         metavar="N", help="linear warm-up from --lr/N to --lr over the first N steps"),
    Flag("--decay-steps", "adam.decay_steps", type=int, metavar="N",
         help="the step the decay reaches --min-lr (default: --steps)"),
    Flag("--min-lr", "adam.min_lr", type=float, default=AdamConfig().min_lr,
         help="learning rate at the end of the decay"),
    Flag("--weight-decay", "adam.weight_decay", type=float, default=AdamConfig().weight_decay,
         help="decoupled weight decay (AdamW) of the decayed parameters"),
    Flag("--no-decay", "adam.no_decay", metavar="PATTERNS",
         help="comma-separated name patterns (fnmatch) exempt from weight decay, '' for none "
         "(default: parameters of fewer than 2 dims: biases, norm weights)"),
    Flag("--betas", "adam.beta1", metavar="B1,B2",
         help=f"AdamW's betas (default: {AdamConfig().beta1},{AdamConfig().beta2})"),
    Flag("--eps", "adam.eps", type=float, default=AdamConfig().eps, help="AdamW's epsilon"),
    Flag("--clip-grad-norm", "adam.clip_grad_norm", type=float, metavar="NORM",
         help="clip the gradients to this global norm (the single-device norm under any "
         "strategy); inf: report the norm without clipping"),
    Flag("--grad-accum", "batch.grad_accum", type=int, default=_default("batch.grad_accum"),
         metavar="N",
         help="accumulate the gradients of N global batches per optimizer step"),
    Flag("--eval-every", "evaluation.every", type=int, default=EvalConfig().every, metavar="N",
         help="after every N-th step, a held-out evaluation: mean loss and perplexity over "
         "--eval-batches batches, forward only (docs/recipe.md); 0: none"),
    Flag("--eval-batches", "evaluation.batches", type=int, default=EvalConfig().batches,
         metavar="K", help="global batches (--global-batch x --seq-len) each evaluation reads, "
         "the same ones every time"),
    Flag("--eval-data", "evaluation.data", metavar="PATH",
         help="held-out data to evaluate on, read as --data is (its flags); or --eval-split"),
    Flag("--eval-split", "evaluation.split", type=float, default=EvalConfig().split, metavar="F",
         help="hold out the last fraction F of --data (of its ids, or bytes): never trained "
         "on, evaluated on"),
    Flag("--data", "data.path",
         help="text or JSONL file or a directory, or a token file: flat .bin, Megatron "
         ".bin/.idx, .npy (docs/data.md) (default: stdlib)"),
    Flag("--dataset", "data.dataset", metavar="FILE.py:FACTORY",
         help="train on the items of a user's dataset instead of tokens: the factory returns "
         "a map-style dataset or an iterable of tensors, tuples or dicts of tensors; the "
         "--model forward takes their fields and returns the loss (docs/data.md)"),
    Flag("--data-max-bytes", "data.max_bytes", type=int, help="read at most this much text"),
    Flag("--data-dtype", "data.dtype", choices=TOKEN_DTYPES,
         help="the ids of a flat .bin token file (default: uint16, as nanoGPT writes)"),
    Flag("--eod-id", "data.eod_id", type=int, metavar="ID",
         help="the end-of-document id of a flat or .npy token file: --tokens-per-step splits "
         "documents there (default: the tokenizer's)"),
    Flag("--tokenizer", "data.tokenizer", metavar="PATH",
         help="tokenizer.json or a local Hugging Face tokenizer folder: --data text is "
         "tokenized once into the cache (docs/data.md)"),
    Flag("--data-cache", "data.cache", metavar="DIR",
         help="where tokenized text and token-file scans are kept (default: $HSPMD_CACHE or "
         "~/.cache/hspmd)"),
    Flag("--schedule", "options.schedule", default=_default("options.schedule"), choices=_choices("options.schedule"),
         help="pipeline schedule"),
    Flag("--dtype", "options.dtype", default=_default("options.dtype"), choices=_choices("options.dtype"),
         help="compute dtype (masters fp32)"),
    Flag("--zero", "options.zero", default="0", choices=("0", "1", "2", "3"),
         help="ZeRO stage, sharded over the data-parallel replicas (docs/zero.md): 1 fp32 "
         "masters and Adam states, 2 also the gradients, 3 also the parameters between uses"),
    Flag("--zero1", None, action="store_true", help="the same as --zero 1"),
    Flag("--zero-no-overlap", "runtime.zero_overlap", action="store_true",
         help="with --zero 2|3: wait for each gradient bucket's reduce at once and gather no "
         "layer ahead (the least memory, the most exposed communication)"),
    Flag("--zero-shares", "options.zero_shares", default="", metavar="W,W,...",
         help="with --zero: one weight per pipeline, its part of the shards in proportion "
         "(e.g. each device's free memory; default: even)"),
    Flag("--sequence-parallel", "options.sequence_parallel", action="store_true",
         help="split the sequence inside each stage"),
    Flag("--recompute", "options.recompute", action="store_true",
         help="recompute each layer in backward"),
    Flag("--recompute-layers", "options.recompute_layers", type=int,
         default=_default("options.recompute_layers"), metavar="K",
         help="with --recompute: only the first K layers of each stage (0: all)"),
    Flag("--no-overlap", "runtime.overlap", action="store_true",
         help="sync gradients after the last backward instead of during it (debugging)"),
    Flag("--switch", "switching.switches", action="append", default=[], metavar='STEP="STRATEGY"',
         type=switch_argument,
         help="switch to STRATEGY (or STEP=@FILE) in memory before step STEP (repeatable)"),
    Flag("--switch-mode", "switching.mode", default=_default("switching.mode"),
         choices=_choices("switching.mode"),
         help="what a switch moves: fp32 masters and Adam states (states, for unstable "
         "devices) or only the compute weights, states kept sharded over all ranks (weights, "
         "for mixed-length data)"),
    Flag("--switch-algo", "switching.algo", default=_default("switching.algo"),
         choices=_choices("switching.algo"),
         help="how a switch moves the states: one fused BSR, or relayed over every NIC of "
         "the nodes (needs --cluster or --ranks-per-node)"),
    Flag("--cluster", "switching.cluster", metavar="FILE_OR_NAME",
         help="the nodes switches plan on"),
    Flag("--ranks-per-node", "switching.ranks_per_node", type=int, metavar="N",
         help="fake nodes of N local processes each, for switches (instead of --cluster)"),
    Flag("--save", "checkpoint.save", metavar="DIR", help="checkpoint directory"),
    Flag("--save-every", "checkpoint.every", type=int, metavar="N",
         help=f"with --save: save after every N-th step (default: {_default('checkpoint.every')})"),
    Flag("--resume", "checkpoint.resume", metavar="DIR", help="continue from DIR"),
    Flag("--elastic", "elastic.enabled", action="store_true",
         help="survive dead and hung ranks in-process: re-plan over the survivors, move the "
         "states from surviving replicas, redo the interrupted step (docs/elastic.md)"),
    Flag("--hang-timeout", "elastic.hang_timeout", type=float,
         default=_default("elastic.hang_timeout"),
         metavar="S", help="with --elastic: a rank without progress for S seconds counts as hung"),
    Flag("--inject-failure", "faults.inject", action="append", default=[],
         metavar="RANK@STEP[:PHASE[:kill|hang]]",
         help="fault injection for tests: RANK fails in PHASE (forward, backward, sync, "
         "optimizer, switch, save, eval; default forward) of STEP by SIGKILL or a hang (repeatable)"),
    Flag("--spares", "elastic.spares", type=int, default=_default("elastic.spares"), metavar="N",
         help="with --elastic: start N more local processes, held back until --grow"),
    Flag("--grow", "elastic.grow", action="append", default=[], metavar="STEP=N",
         help="with --spares: N spare ranks join before STEP (re-plan, states move to them)"),
    Flag("--tokens-per-step", "batch.step_tokens", type=int, metavar="N",
         help="variable-length steps: whole documents of at most N tokens per step, packed "
         "into the strategy's micro-batches (docs/mixed-length.md)"),
    # under --tokens-per-step it takes --seq-len's place (one of the two sets seq_len)
    Flag("--max-seq-len", None, type=int, metavar="L",
         help="with --tokens-per-step: the longest packed row (default: --seq-len)"),
    Flag("--plans", "switching.length_plans", metavar="FILE",
         help="length plans of `hspmd plan --data`: per step the strategy with the least "
         "predicted time, switching bf16 weights when it changes (docs/mixed-length.md)"),
    Flag("--long-docs", "batch.long_docs", default=_default("batch.long_docs"), choices=LONG_DOCS,
         help="with --tokens-per-step: a document over --max-seq-len tokens is cut to it, "
         "left out, or refused (counted in the step records)"),
    Flag("--device", "runtime.device", default=_default("runtime.device"),
         choices=_choices("runtime.device"),
         help="where ranks compute: auto (CUDA with nccl when there is a GPU per rank, else "
         "CPU with gloo), cpu, or cuda; the reference: CUDA when there is a GPU"),
    Flag("--slowdown", "faults.slowdown", default="", metavar="RANK=FACTOR,...",
         help="emulate slower devices: each listed rank sleeps (FACTOR-1) x the time of each "
         "forward, backward and optimizer step it runs, e.g. 2=3,5=3; losses are unchanged"),
)  # fmt: skip
FLAGS = {flag.name: flag for flag in TRAIN_FLAGS}

# The strategy options' flags (hspmd.plan.strategy.StrategyOptions): explain, simulate.
STRATEGY_FLAGS = (
    "--zero",
    "--zero1",
    "--zero-shares",
    "--sequence-parallel",
    "--recompute",
    "--schedule",
    "--dtype",
)  # fmt: skip  (--zero-no-overlap is a runtime flag of train only)


def zero_of(args: argparse.Namespace) -> int:
    """The ZeRO stage of ``--zero`` and its synonym ``--zero1`` (``--zero 1``)."""
    stage = int(getattr(args, "zero", 0) or 0)
    if getattr(args, "zero1", False) is True:
        if stage not in (0, 1):
            raise TrainError(f"--zero1 with --zero {stage}: --zero1 is --zero 1; give one of them")
        return 1
    return stage


def shares_of(args: argparse.Namespace) -> tuple[float, ...]:
    """``--zero-shares 3,1`` -> ``(3.0, 1.0)``; ``''`` -> ``()``."""
    text = getattr(args, "zero_shares", "") or ""
    try:
        return tuple(float(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise TrainError(
            f"--zero-shares {text!r}: give numbers, one per pipeline, e.g. 3,1,1,1"
        ) from None


# TrainConfig fields without a flag of their own, and why.
NOT_FLAGS = {
    "model.tp_rules": "a user module's TP kinds come from a plan file: --plan (planfile)",
    "runtime.bucket_bytes": "a tuning knob of the library API (RuntimeConfig), no flag",
    "batch.min_documents": "aligns the steps of runs under different strategies, no flag",
    "runtime.measure_memory": "the state's tracked bytes per rank for benchmarks/zero.py, no flag",
    "adam.beta2": "set with beta1 by --betas B1,B2",
}


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str], **changes: object) -> None:
    """Add the flags ``names`` of ``TRAIN_FLAGS`` to a parser of another command, as
    ``hspmd train`` has them (``changes``: as ``Flag.add``'s, for every one)."""
    for name in names:
        FLAGS[name].add(parser, **changes)
