"""A strategy as ``hspmd plan --out`` chooses it: the strategy string, the options that go
with it, the model and length it was planned for (format ``hspmd.strategy/1``).

hspmd writes three JSON files that name strategies, each with its own ``format``:

    format                 written by                       read by
    hspmd.strategy/1       hspmd plan --out                 train, explain, simulate --plan
    hspmd.plan/1           hspmd train --save-plan          train, explain, simulate --plan
    hspmd.length-plans     hspmd plan --data ... --out      hspmd train --plans

A strategy file holds what ``hspmd train`` needs besides the model; the annotation plan
(``hspmd.plan.schema``) adds every tensor's annotation. The planner's other fields (step
time, memory, the homogeneous baseline) ride along and are not read back.

>>> from hspmd.models import get_model
>>> from hspmd.plan.identity import ModelIdentity
>>> model = ModelIdentity.of(get_model("llama-tiny"), source="llama-tiny")
>>> data = choice_fields(strategy="2x1: R0:L0-3; 2x1: R1:L0-3", options=StrategyOptions(),
...                      model=model, seq_len=64, global_batch=4)
>>> data["format"], data["options"]["schedule"]
('hspmd.strategy/1', '1f1b')
>>> choice = choice_from_json({**data, "step_time_s": 0.5})
>>> choice.strategy, choice.seq_len, choice.model == model
('2x1: R0:L0-3; 2x1: R1:L0-3', 64, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hspmd.errors import StrategyError
from hspmd.plan.identity import ModelIdentity
from hspmd.plan.strategy import StrategyOptions

__all__ = ["STRATEGY_FORMAT", "StrategyChoice", "choice_fields", "choice_from_json"]

STRATEGY_FORMAT = "hspmd.strategy/1"


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategyChoice:
    """A planned strategy with its options; the length, batch and model it was planned
    for (None where a file written before they were recorded lacks them)."""

    strategy: str
    options: StrategyOptions
    seq_len: int | None = None
    global_batch: int | None = None
    model: ModelIdentity | None = None


def choice_fields(
    *, strategy: str, options: StrategyOptions, model: ModelIdentity, seq_len: int,
    global_batch: int,
) -> dict[str, Any]:  # fmt: skip
    """The fields that make a planner's JSON a strategy file (``hspmd plan --out``)."""
    return {
        "format": STRATEGY_FORMAT,
        "strategy": strategy,
        "options": {**dataclasses.asdict(options), "zero_shares": list(options.zero_shares)},
        "model": model.to_json(),
        "seq_len": seq_len,
        "global_batch": global_batch,
    }


def choice_from_json(data: Mapping[str, Any], *, where: str = "the file") -> StrategyChoice:
    """A strategy file (``choice_fields`` plus anything); files of ``hspmd plan`` from
    before formats were named (no ``format``, no ``options``) read their flat option keys."""
    if not isinstance(data.get("strategy"), str):
        raise StrategyError(f'{where}: a strategy file names its "strategy" (a string)')
    flat = {k: data[k] for k in ("zero1", "sequence_parallel", "schedule", "dtype") if k in data}
    per_stage = data.get("recompute_layers")  # the layers each stage recomputes
    if isinstance(per_stage, list) and data.get("recompute"):
        flat["recompute_layers"] = max((int(k) for ks in per_stage for k in ks), default=0)
    if "recompute" in data:
        flat["recompute"] = data["recompute"]
    raw = data.get("options", flat)
    try:
        options = StrategyOptions.from_dict(raw)
    except TypeError:
        allowed = ", ".join(f.name for f in dataclasses.fields(StrategyOptions))
        raise StrategyError(f"{where}: options {sorted(raw)}: allowed are {allowed}") from None
    model = data.get("model")
    return StrategyChoice(
        strategy=data["strategy"], options=options,
        seq_len=_count(data, "seq_len", where), global_batch=_count(data, "global_batch", where),
        model=None if model is None else ModelIdentity.from_json(model, where=where),
    )  # fmt: skip


def _count(data: Mapping[str, Any], key: str, where: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or value < 1:
        raise StrategyError(f"{where}: {key} is {value!r}: give a positive integer")
    return value
