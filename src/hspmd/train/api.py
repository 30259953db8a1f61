"""The Python API of a run: ``hspmd.fit(model, strategy, ...)``, which the CLI mirrors, and
``train_config``, the one place its typed keywords become a ``TrainConfig``.

``model`` is a preset name (``"llama-tiny"``), a factory's source (``"my_model.py:make"``,
``"package.module:make"``), a Hugging Face folder (``"hf:path/to/dir"``: its config and
weights, docs/checkpoints.md) or the factory itself (a module-level function: processes
rebuild the model from its module, or from the file of ``__main__``). The keywords are
``RunOptions``: flat names, typed, each a field of ``TrainConfig`` or of one of its sections
(``hspmd.train.sections.SECTIONS``: ``seq_len`` is ``batch.seq_len``, ``lr`` ``adam.lr``),
plus ``model_kwargs`` (the factory's keyword arguments); ``global_batch`` defaults to the
strategy's (its sum of COUNT x SIZE)::

    import hspmd

    def make():
        return MyModel(width=64)

    if __name__ == "__main__":          # the ranks are spawned processes
        result = hspmd.fit(make, "2x1: R0-1:L0-1; 2x1: R2:L0-1", steps=10, lr=1e-3)
        print(result.losses)

``reference=True`` trains the plain module on this process instead (same data).

>>> config = train_config("llama-tiny", "2x1: R0:L0-3; 1x2: R1:L0-3", lr=1e-3,
...                       model_kwargs={"num_layers": 2})
>>> config.batch.global_batch, config.adam.lr, config.model.overrides
(4, 0.001, (('num_layers', 2),))
>>> train_config("llama-tiny", learning_rate=1e-3)
Traceback (most recent call last):
...
hspmd.train.sections.TrainError: unknown option 'learning_rate': give one of strategy, ...
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict, Unpack, get_type_hints

from hspmd.checkpoint.store import foreign_checkpoint
from hspmd.models.hf import HF_PREFIX, hf_source
from hspmd.plan.strategy import Dtype, Schedule, Strategy, parse_strategy
from hspmd.train.config import (
    AdamConfig,
    Device,
    EvalConfig,
    LengthPlans,
    LrSchedule,
    Record,
    SwitchAlgo,
    SwitchMode,
    TrainConfig,
    TrainError,
    routed,
)
from hspmd.train.faults import Injection
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import train

__all__ = ["Changes", "RunOptions", "fit", "model_source", "revise", "train_config"]

REFERENCE_BATCH = 8  # sequences a step without a strategy (a reference run), as the CLI


class RunOptions(TypedDict, total=False):
    """The typed keywords of ``fit``, ``build`` and ``train_config``: the flat names of
    ``TrainConfig``'s fields and its sections' (``SECTIONS``; docs/api.md lists them with
    their meaning and field), and ``model_kwargs``."""

    model_kwargs: Mapping[str, Any] | Sequence[tuple[str, Any]]
    tp_rules: Sequence[tuple[str, str]] | None
    global_batch: int | None
    seq_len: int
    steps: int
    seed: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float  # the recipe's fields (docs/recipe.md) flat, as the CLI's flags
    no_decay: Sequence[str] | None
    lr_schedule: LrSchedule
    warmup_steps: int
    decay_steps: int | None
    min_lr: float
    adam: AdamConfig  # all of them at once (the flat names above win over it)
    evaluation: EvalConfig
    clip_grad_norm: float | None
    grad_accum: int
    data: str | None
    dataset: str | None  # a user's dataset of any items (docs/data.md, "Any batch")
    data_max_bytes: int | None
    data_dtype: str | None
    eod_id: int | None
    tokenizer: str | None
    data_cache: str | None
    schedule: Schedule
    dtype: Dtype
    zero: int
    zero1: bool  # the same as zero=1 (as the CLI's --zero1)
    zero_shares: Sequence[float]
    zero_overlap: bool
    sequence_parallel: bool
    recompute: bool
    recompute_layers: int
    overlap: bool
    bucket_bytes: int
    switches: Sequence[tuple[int, str | Strategy]]
    switch_mode: SwitchMode
    switch_algo: SwitchAlgo
    cluster: str | None
    ranks_per_node: int | None
    save: str | None
    save_every: int
    resume: str | None
    slowdown: Sequence[tuple[int, float]]
    elastic: bool
    hang_timeout: float
    inject: Sequence[Injection]
    spares: int
    grow: Sequence[tuple[int, int]]
    measure_memory: bool
    step_tokens: int | None
    long_docs: str
    min_documents: int
    length_plans: LengthPlans | None
    device: Device


def model_source(model: str | Callable[..., Any]) -> str:
    """The text form of ``model`` that every process can load (module docstring);
    ``hf:DIR`` with DIR made absolute and checked (``hspmd.models.hf``)."""
    if isinstance(model, str):
        return hf_source(model) if model.startswith(HF_PREFIX) else model
    name = getattr(model, "__qualname__", "")
    module = getattr(model, "__module__", None)
    if not callable(model) or not name.isidentifier():
        raise TrainError(
            f"model {model!r}: give a preset name, 'FILE.py:FUNCTION', or a module-level "
            "function that returns the nn.Module (not a lambda or a nested function)"
        )
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise TrainError(
                f"model {name}: defined in an interactive session, which worker processes "
                "cannot import; put it in a file and pass 'FILE.py:FUNCTION'"
            )
        return f"{Path(path).resolve()}:{name}"
    return f"{module}:{name}"


def _frozen(value: Any) -> Any:
    """Lists and dicts as tuples (a config is a hashable value)."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value


def train_config(
    model: str | Callable[..., Any] = "llama-tiny",
    strategy: str | Strategy | None = None,
    **options: Unpack[RunOptions],
) -> TrainConfig:
    """The ``TrainConfig`` of ``fit(model, strategy, **options)`` (module docstring)."""
    _check_names(options, RunOptions, extra=("strategy",))
    start = _strategy(strategy)
    fields = _fields(options)
    if fields.get("global_batch") is None:
        fields["global_batch"] = REFERENCE_BATCH if start is None else start.global_batch
    config = routed(TrainConfig(), {"model": model_source(model), "strategy": start, **fields})
    config.check_model()  # the model loads here, at the edge, not in the config
    return config


class Changes(RunOptions, total=False):
    """The keywords of ``revise``: ``RunOptions`` and the model and strategy."""

    model: str | Callable[..., Any]
    strategy: str | Strategy | None


def revise(config: TrainConfig, **changes: Unpack[Changes]) -> TrainConfig:
    """``config`` with ``changes``: ``train_config``'s keywords (a strategy's text parsed
    here, ``lr`` into ``adam``, ``model_kwargs`` as the overrides), each routed to its field.

    >>> config = revise(train_config(), strategy="2x1: R0:L0-3", lr=1e-3)
    >>> str(config.strategy), config.adam.lr, config.batch.global_batch
    ('2x1: R0:L0-3', 0.001, 8)
    """
    _check_names(changes, Changes)
    options = {k: v for k, v in changes.items() if k not in ("model", "strategy")}
    fields = _fields(options)
    if "model" in changes:
        fields["model"] = model_source(changes["model"])
    if "strategy" in changes:
        fields["strategy"] = _strategy(changes["strategy"])
    if "global_batch" in fields and fields["global_batch"] is None:
        chosen = fields.get("strategy", config.strategy)
        fields["global_batch"] = REFERENCE_BATCH if chosen is None else chosen.global_batch
    revised = routed(config, fields)
    revised.check_model()
    return revised


def _check_names(options: Mapping[str, Any], kind: Any, *, extra: Sequence[str] = ()) -> None:
    """An unknown keyword is one line: the closest known name if one is close (a typo, or
    a CLI flag's spelling), then every allowed name."""
    names = [*extra, *get_type_hints(kind)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        close = difflib.get_close_matches(unknown[0].replace("-", "_"), names, n=1, cutoff=0.7)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TrainError(f"unknown option {unknown[0]!r}: {hint}give one of {', '.join(names)}")


def _fields(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` (``RunOptions``) by flat name, as ``routed`` takes them: ``model_kwargs``
    as ``model_overrides``, ``zero1`` as ``zero=1``, a ``None`` ``lr`` left out (``adam``'s
    stays), strategies parsed, sequences as tuples."""
    fields: dict[str, Any] = dict(options)
    if "model_kwargs" in fields:
        fields["model_overrides"] = _frozen(dict(fields.pop("model_kwargs") or {}))
    if fields.get("lr", 0) is None:
        del fields["lr"]
    if "switches" in fields:
        fields["switches"] = tuple((int(step), _strategy(s)) for step, s in fields["switches"])
    if fields.pop("zero1", False):
        if fields.get("zero", 1) != 1:
            raise TrainError(f"zero1=True with zero={fields['zero']}: zero1 is zero=1; give one")
        fields["zero"] = 1
    for name in ("slowdown", "grow", "zero_shares", "inject", "tp_rules", "no_decay"):
        if name in fields:
            fields[name] = _frozen(fields[name])
    return fields


def _strategy(strategy: str | Strategy | None) -> Strategy | None:
    """A strategy given as text is parsed here, at the edge; everything below takes values."""
    return parse_strategy(strategy) if isinstance(strategy, str) else strategy


def fit(
    model: str | Callable[..., Any] = "llama-tiny",
    strategy: str | Strategy | None = None,
    *,
    reference: bool = False,
    on_step: Callable[[Record], None] | None = None,
    **options: Unpack[RunOptions],
) -> TrainResult:
    """Train ``model`` under ``strategy`` on local processes (module docstring), or with
    ``reference=True`` the plain model on this process; ``on_step(record)`` after each step
    and each held-out evaluation (``evaluation=EvalConfig(every=N, ...)``)."""
    config = train_config(model, strategy, **options)
    if reference:
        return run_reference(config, on_step=on_step)
    save = config.checkpoint.save
    held = None if save is None else foreign_checkpoint(save, config.checkpoint.resume)
    if held is not None:
        raise TrainError(
            f"save={save!r} already holds checkpoint {held} of another run: saving there would "
            f"delete it, or delete this run's own steps as they are written; give save a new "
            f"folder, or resume={save!r} to continue that run"
        )
    return train(config, on_step=on_step)
