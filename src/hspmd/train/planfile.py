"""A plan file (``hspmd.plan/1`` JSON, docs/plan-schema.md) as the one input of a run.

``hspmd train --plan plan.json`` trains what the plan says: its strategy, its options, its
sequence length, and the split of every parameter inside a stage, read from the plan's
per-parameter annotations (``{0:t}`` column, ``{1:t}`` row, ``{D:t}`` replicate: one rule
per parameter, ahead of the model's own ``tp_rules``, which still decide the parameters
that no stage of more than one rank holds). The plan must then be
exactly what hspmd derives from those (``build_plan``): every entry is compared and the
first that differs is named, so a plan never trains as something other than it says.
``hspmd train ... --save-plan plan.json`` writes the plan of a run, to edit or to keep.

>>> from hspmd.annotation import parse_annotation as A
>>> from hspmd.plan.params import ParamSpec
>>> kind_of(ParamSpec("w", (8, 4), A("hD: [0,1]{1:2} [2]{}")))
'row'
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hspmd.annotation import DUP
from hspmd.errors import StrategyError
from hspmd.plan.params import ParamSpec
from hspmd.plan.schema import SECTIONS, Plan, build_plan, plan_from_json, plan_to_json
from hspmd.plan.strategy import parse_strategy
from hspmd.train.active import options_of
from hspmd.train.config import TrainConfig, TrainError

__all__ = ["check_plan", "config_from_plan", "kind_of", "read_plan", "write_plan"]


def kind_of(spec: ParamSpec) -> str | None:
    """The TP kind a parameter's annotation shows: the first split found in a subgroup;
    None where no subgroup has more than one rank (the model's own rule stands)."""
    for ds in spec.annotation.states:
        for dim, degree in ds.entries:
            if degree > 1 and dim >= 0:
                if len(spec.shape) > 1 and dim == 1:
                    return "row"
                if dim == 0:
                    return "column"
                raise StrategyError(
                    f"plan parameter {spec} splits dim {dim} inside a stage: hspmd splits "
                    "weights on dim 0 (column, vocab) or dim 1 (row) only"
                )
            if degree > 1 and dim != DUP:
                raise StrategyError(f"plan parameter {spec} is partial: give a layout, not sums")
    many = any(degree > 1 for ds in spec.annotation.states for _, degree in ds.entries)
    return "replicate" if many else None


def read_plan(path: str) -> Plan:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise TrainError(f"--plan {path}: cannot read it ({error.strerror})") from None
    return plan_from_json(text)


def config_from_plan(plan: Plan, config: TrainConfig) -> TrainConfig:
    """``config`` with the plan's strategy, options, sequence length and TP kinds."""
    if plan.strategy is None:
        raise TrainError(
            "the plan names no strategy: hspmd trains plans written from one "
            '(hspmd train --save-plan); add its "strategy"'
        )
    tokens = next((s for s in plan.inputs if s.name == "tokens"), None)
    if tokens is None or len(tokens.shape) != 2:
        raise TrainError('the plan\'s inputs lack "tokens" (B, T): add it (docs/plan-schema.md)')
    kinds = {spec.name: kind_of(spec) for spec in plan.parameters}
    rules = tuple((name, kind) for name, kind in kinds.items() if kind is not None)
    options = plan.options
    strategy = parse_strategy(plan.strategy)
    return dataclasses.replace(
        config,
        strategy=plan.strategy,
        global_batch=strategy.global_batch,
        seq_len=tokens.shape[1],
        tp_rules=rules if config.module_model else None,
        zero1=options.zero1,
        sequence_parallel=options.sequence_parallel,
        recompute=options.recompute,
        recompute_layers=options.recompute_layers,
        schedule=options.schedule,
        dtype=options.dtype,
    )


def derived_plan(config: TrainConfig) -> Plan:
    """The plan hspmd derives for ``config``'s starting strategy."""
    return build_plan(
        parse_strategy(config.require_strategy()), config.model_config(),
        seq_len=config.seq_len, options=options_of(config), global_batch=config.global_batch,
    )  # fmt: skip


def check_plan(plan: Plan, config: TrainConfig) -> None:
    """StrategyError naming the first entry of ``plan`` that ``config`` would not train."""
    want = plan_to_json(derived_plan(config))
    got = plan_to_json(plan)
    for section in SECTIONS:
        for name in sorted(set(want[section]) | set(got[section])):
            mine, theirs = want[section].get(name), got[section].get(name)
            if mine == theirs:
                continue
            if theirs is None:
                raise StrategyError(f"the plan lacks {section}[{name!r}]: add {json.dumps(mine)}")
            if mine is None:
                raise StrategyError(
                    f"the plan's {section}[{name!r}] is not in {config.model}: drop it"
                )
            raise StrategyError(
                f"the plan's {section}[{name!r}] is {json.dumps(theirs)}, but its strategy and "
                f"parameter layouts give {json.dumps(mine)}: hspmd trains plans of that form "
                "only (docs/plan-schema.md); edit the entry or regenerate the plan"
            )


def write_plan(config: TrainConfig, path: str) -> dict[str, Any]:
    """Write the plan of ``config``'s starting strategy to ``path``; returns it."""
    data = plan_to_json(derived_plan(config))
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data
