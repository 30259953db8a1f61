"""A plan file as the one input of a run: an annotation plan (``hspmd.plan/1`` JSON,
docs/plan-schema.md) or a strategy file of ``hspmd plan --out`` (``hspmd.strategy/1``,
``hspmd.plan.choice``). Both name their model (``hspmd.plan.identity``): a plan for another
model is refused in one line naming both, before any entry is compared.

``hspmd train --plan strategy.json`` trains the planner's strategy with its options, length
and global batch. ``hspmd train --plan plan.json`` trains what the plan says: its strategy,
its options, its
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
from typing import Any, TypeAlias

from hspmd.annotation import DUP
from hspmd.errors import StrategyError
from hspmd.plan.choice import STRATEGY_FORMAT, StrategyChoice, choice_from_json
from hspmd.plan.identity import check_identity
from hspmd.plan.params import ParamSpec
from hspmd.plan.schema import FORMAT, SECTIONS, Plan, build_plan, plan_from_json, plan_to_json
from hspmd.plan.strategy import parse_strategy
from hspmd.train.config import TrainConfig, TrainError
from hspmd.train.identity import model_identity

__all__ = [
    "PlanFile", "check_plan", "config_from_plan", "kind_of", "read_plan", "write_plan",
]  # fmt: skip

PlanFile: TypeAlias = Plan | StrategyChoice
"""What ``--plan`` reads: an annotation plan or a planner's strategy."""


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


def read_plan(path: str, *, flag: str = "--plan") -> PlanFile:
    """The plan file at ``path`` by its ``format``; another hspmd file is refused with the
    flag that takes it (a ``hspmd plan`` file from before formats were named reads as a
    strategy file)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise TrainError(f"{flag} {path}: cannot read it ({error.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TrainError(f"{flag} {path}: not JSON ({error})") from None
    kind = data.get("format") if isinstance(data, dict) else None
    if kind == FORMAT:
        return plan_from_json(data)
    if kind == STRATEGY_FORMAT or (kind is None and "step_time_s" in data and "strategy" in data):
        return choice_from_json(data, where=f"{flag} {path}")
    if kind == "hspmd.length-plans":
        raise TrainError(
            f"{flag} {path} is a length-plans file (hspmd plan --data): give it to "
            f"hspmd train as --plans {path}"
        )
    raise TrainError(
        f"{flag} {path}: format {kind!r} is not a plan: give a strategy file ({STRATEGY_FORMAT}, "
        f"from hspmd plan --out) or an annotation plan ({FORMAT}, from hspmd train --save-plan)"
    )


def config_from_plan(plan: PlanFile, config: TrainConfig) -> TrainConfig:
    """``config`` with the plan's strategy, options and sequence length (an annotation plan's
    TP kinds too); a plan of another model is refused naming both."""
    if plan.model is not None:
        check_identity(
            plan.model, model_identity(config), what="the plan",
            fix=f"give --model {plan.model.source} (and its --config), or plan for this model",
        )  # fmt: skip
    if isinstance(plan, StrategyChoice):
        return _config_from_choice(plan, config)
    if plan.strategy is None:
        raise TrainError(
            "the plan names no strategy: hspmd trains plans written from one "
            '(hspmd train --save-plan); add its "strategy"'
        )
    tokens = next((s for s in plan.inputs if s.name == "tokens"), None)
    if config.data.dataset is None and (tokens is None or len(tokens.shape) != 2):
        raise TrainError('the plan\'s inputs lack "tokens" (B, T): add it (docs/plan-schema.md)')
    kinds = {spec.name: kind_of(spec) for spec in plan.parameters}
    rules = tuple((name, kind) for name, kind in kinds.items() if kind is not None)
    options = plan.options
    strategy = parse_strategy(plan.strategy)  # the file's text, read here (an edge)
    seq_len = tokens.shape[1] if tokens is not None else config.batch.seq_len  # none: --dataset
    return dataclasses.replace(
        config,
        strategy=strategy,
        batch=dataclasses.replace(
            config.batch, global_batch=strategy.global_batch, seq_len=seq_len
        ),
        model=dataclasses.replace(
            config.model, tp_rules=rules if config.model.user_module else None
        ),
        options=options,
    )


def _config_from_choice(choice: StrategyChoice, config: TrainConfig) -> TrainConfig:
    options = choice.options
    strategy = parse_strategy(choice.strategy)  # the file's text, read here (an edge)
    return dataclasses.replace(
        config,
        strategy=strategy,
        batch=dataclasses.replace(
            config.batch,
            global_batch=strategy.global_batch,
            seq_len=choice.seq_len or config.batch.seq_len,
        ),
        options=options,
    )


def derived_plan(config: TrainConfig) -> Plan:
    """The plan hspmd derives for ``config``'s starting strategy, naming its model."""
    plan = build_plan(
        config.require_strategy(), config.model_config(),
        seq_len=config.batch.seq_len, options=config.options,
        global_batch=config.batch.global_batch,
    )  # fmt: skip
    return dataclasses.replace(plan, model=model_identity(config))


def check_plan(plan: PlanFile, config: TrainConfig) -> None:
    """StrategyError naming the first entry of ``plan`` that ``config`` would not train (a
    strategy file has no entries: it trains as hspmd derives it)."""
    if isinstance(plan, StrategyChoice):
        return
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
                    f"the plan's {section}[{name!r}] is not in {config.model.source}: drop it"
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
