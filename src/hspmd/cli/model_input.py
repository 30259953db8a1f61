"""The model (and, with ``--plan``, the run) a command reads: one input for every command.

``--model`` is a preset (``llama-tiny``, ..., ``llama-70b``), any nn.Module's factory,
``FILE.py:FUNCTION`` or ``package.module:FUNCTION`` (docs/models.md), or ``hf:DIR``, a
local Hugging Face folder (config.json and safetensors weights: docs/checkpoints.md);
``--config JSON`` gives the factory's keyword arguments (a preset's fields, an ``hf:DIR``
config's fields to override). ``--plan
plan.json`` (docs/plan-schema.md) gives the strategy, the options, the sequence length and
every parameter's split, as ``hspmd train --plan`` reads it: ``explain`` and ``simulate``
take it in place of ``--strategy``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hspmd.models import get_model
from hspmd.models.hf import HF_PREFIX, hf_source
from hspmd.models.spec import NO_LIMIT, ModelSpec, ModelSpecError
from hspmd.plan.strategy import Strategy, StrategyOptions, parse_strategy

__all__ = [
    "Run",
    "add_model_arguments",
    "seq_len_of",
    "model_argument",
    "model_kwargs",
    "read_model",
    "read_run",
]


def model_argument(presets: list[str]) -> Callable[[str], str]:
    """``--model``'s type: a preset name, a factory with a file made absolute, or
    ``hf:DIR`` with DIR absolute (every process, on any node, loads the same file)."""

    def parse(text: str) -> str:
        if text in presets:
            return text
        if text.startswith(HF_PREFIX):
            try:
                return hf_source(text)
            except ModelSpecError as error:
                raise argparse.ArgumentTypeError(str(error)) from None
        where, sep, name = text.rpartition(":")
        if not sep or not where or not name.isidentifier():
            raise argparse.ArgumentTypeError(
                f"{text!r} is neither a preset ({', '.join(presets)}) nor FILE.py:FUNCTION / "
                "package.module:FUNCTION / hf:DIR"
            )
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise argparse.ArgumentTypeError(f"no file {where} (from {text!r})")
            return f"{path.resolve()}:{name}"
        return text

    return parse


def model_kwargs(text: str | None) -> tuple[tuple[str, Any], ...]:
    """``--config``: a JSON object, inline or in a file, as sorted hashable items."""
    if text is None:
        return ()
    if text.endswith(".json") and not Path(text).is_file():
        raise ModelSpecError(
            f"--config {text!r}: no such file: give an existing .json file, or the JSON object "
            "itself, e.g. '{\"num_layers\": 2}'"
        )
    source = Path(text).read_text() if text.endswith(".json") else text
    try:
        data = json.loads(source)
    except json.JSONDecodeError as error:
        raise ModelSpecError(
            f"--config {text!r} is not JSON ({error}): give e.g. '{{\"num_layers\": 2}}'"
        ) from None
    if not isinstance(data, dict):
        raise ModelSpecError(f"--config {text!r}: give a JSON object of keyword arguments")

    def frozen(value: Any) -> Any:
        if isinstance(value, list):
            return tuple(frozen(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, frozen(v)) for k, v in value.items()))
        return value

    return tuple(sorted((str(k), frozen(v)) for k, v in data.items()))


def add_model_arguments(
    parser: argparse.ArgumentParser, *, presets: list[str], default: str | None, plan: bool
) -> None:
    """``--model`` and ``--config``; ``--plan`` where the command takes a plan."""
    parser.add_argument(
        "--model",
        default=default,
        required=default is None,
        type=model_argument(presets),
        help=f"a preset ({', '.join(presets)}), any nn.Module's factory: FILE.py:FUNCTION "
        "or package.module:FUNCTION (docs/models.md), or hf:DIR, a local Hugging Face folder "
        "(docs/checkpoints.md)",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="JSON object (or a .json file): the factory's keyword arguments, or preset "
        """fields to override, e.g. '{"num_layers": 2}'""",
    )
    if plan:
        parser.add_argument(
            "--plan",
            default=None,
            metavar="FILE.json",
            help="a strategy file (hspmd plan --out) or an annotation plan (hspmd train "
            "--save-plan; docs/plan-schema.md): its strategy, options, sequence length (and "
            "per-parameter splits); instead of --strategy",
        )


def read_model(args: argparse.Namespace) -> ModelSpec:
    """The model ``--model`` and ``--config`` name (with ``--dataset``: called with its
    items' fields), as metadata (nothing allocated)."""
    kwargs = dict(model_kwargs(getattr(args, "config", None)))
    dataset = getattr(args, "dataset", None)
    if dataset is None:
        return get_model(args.model, **kwargs)
    from hspmd.models.module import load_model
    from hspmd.train.config import dataset_items

    if ":" not in args.model:
        raise ModelSpecError(
            f"--dataset needs --model FILE.py:FACTORY, not the preset {args.model}"
        )
    return load_model(args.model, kwargs, items=dataset_items(dataset))


@dataclass(frozen=True, slots=True)
class Run:
    """What a metadata command works on: the model, the strategy, options, length."""

    model: ModelSpec
    strategy: Strategy
    options: StrategyOptions
    seq_len: int | None  # None: the command's default


def read_run(args: argparse.Namespace, options: StrategyOptions) -> Run:
    """The model with ``--strategy`` and the command's ``options``, or with ``--plan`` the
    plan's strategy, options, sequence length and parameter splits (checked against what
    hspmd derives from them, as ``hspmd train --plan``)."""
    path = getattr(args, "plan", None)
    if path is None:
        if args.strategy is None:
            raise ModelSpecError('give --strategy "COUNTxSIZE: R..:L.." or --plan plan.json')
        model = read_model(args)
        return Run(model, parse_strategy(args.strategy), options, getattr(args, "seq_len", None))
    if args.strategy is not None:
        raise ModelSpecError("--plan carries the strategy: drop --strategy (or drop --plan)")
    from hspmd.data.source import DataSpec
    from hspmd.plan.schema import Plan
    from hspmd.train.config import BatchConfig, ModelChoice, TrainConfig
    from hspmd.train.planfile import check_plan, config_from_plan, read_plan

    plan = read_plan(path)
    if isinstance(plan, Plan):
        tokens = next((t for t in plan.inputs if t.name == "tokens" and len(t.shape) == 2), None)
        seq_len = tokens.shape[1] if tokens is not None else 64
    else:  # a strategy file of hspmd plan --out
        seq_len = plan.seq_len or 64
    base = TrainConfig(
        model=ModelChoice(source=args.model, overrides=model_kwargs(args.config)),
        batch=BatchConfig(seq_len=seq_len), data=DataSpec(dataset=getattr(args, "dataset", None)),
    )  # fmt: skip
    config = config_from_plan(plan, base)
    check_plan(plan, config)
    assert config.strategy is not None
    return Run(config.model_config(), config.strategy, config.options, config.batch.seq_len)


def seq_len_of(model: ModelSpec, given: int | None) -> int:
    """``--seq-len``, else the model's ``max_seq_len`` (a model that states none needs one);
    1 for a dataset's model (its fields have no sequence dim)."""
    if getattr(model, "batch", ()):
        return 1
    if given is not None:
        if given < 1:
            raise ModelSpecError(f"--seq-len {given}: give a positive sequence length")
        if given > model.max_seq_len:  # what train refuses is not planned, costed or explained
            raise ModelSpecError(
                f"--seq-len {given} exceeds {model.name}'s max_seq_len={model.max_seq_len} (its "
                f"longest position): give --seq-len {model.max_seq_len} or less, or a model "
                "with more positions"
            )
        return given
    if model.max_seq_len >= NO_LIMIT:
        raise ModelSpecError(
            f"{model.name} states no max_seq_len: give --seq-len (or set the module's "
            "max_seq_len attribute)"
        )
    return model.max_seq_len
