"""The plans file of ``hspmd plan --data`` (docs/mixed-length.md, "The plans file"):
written by ``plans_json``, read back by ``load_plans``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hspmd.cost.lines import CostModel
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import StrategyOptions
from hspmd.planner.length_dispatch import switch_seconds
from hspmd.planner.length_model import (
    Histogram,
    LengthPlanError,
    LengthStrategy,
    PipeConfig,
    PipeModel,
    PipeSpec,
)

__all__ = ["load_plans", "plans_json", "switch_matrix"]


def plans_json(
    plans: Sequence[LengthStrategy], hist: Histogram, *, model: str, cluster: str,
    step_tokens: int, switch: Sequence[Sequence[float]],
) -> dict[str, Any]:  # fmt: skip
    """The ``hspmd plan --data`` file (docs/mixed-length.md, "The plans file");
    ``switch[i][j]``: the predicted seconds of the switch from strategy ``i`` to ``j``."""
    return {
        "format": "hspmd.length-plans", "version": 1, "model": model, "cluster": cluster,
        "tokens_per_step": step_tokens, "max_len": hist.max_len,
        "histogram": hist.to_json(), "strategies": [p.to_json() for p in plans],
        "switch_s": [[float(x) for x in row] for row in switch],
    }  # fmt: skip


def switch_matrix(
    plans: Sequence[LengthStrategy], config: ModelSpec, cost: CostModel
) -> list[list[float]]:
    """``switch_seconds`` between every pair of ``plans`` (0 on the diagonal)."""
    return [
        [0.0 if i == j else switch_seconds(a.strategy, b.strategy, config, cost)
         for j, b in enumerate(plans)]
        for i, a in enumerate(plans)
    ]  # fmt: skip


def load_plans(data: Any, where: str) -> tuple[list[LengthStrategy], list[list[float]]]:
    """The strategies of a plans file (``plans_json``) and its switch matrix."""
    from hspmd.plan.strategy import StrategyError, parse_strategy

    kind = data.get("format") if isinstance(data, dict) else None
    planned = isinstance(data, dict) and kind is None and "step_time_s" in data  # older files
    if kind in ("hspmd.plan/1", "hspmd.strategy/1") or planned:
        what = "an annotation plan" if kind == "hspmd.plan/1" else "a strategy file"
        raise LengthPlanError(
            f"{where} is {what} (format {kind}), not length plans: give it as --plan instead"
        )
    if kind != "hspmd.length-plans":
        raise LengthPlanError(
            f"{where}: not a plans file (format hspmd.length-plans): write one with "
            "`hspmd plan --data PATH --max-seq-len L --tokens-per-step N --out FILE`"
        )
    if data.get("version") != 1:
        raise LengthPlanError(
            f"{where}: plans file version {data.get('version')!r}, this hspmd reads version 1: "
            "write it again with this hspmd's `hspmd plan --data`"
        )
    out = []
    try:
        for entry in data["strategies"]:
            strategy = parse_strategy(entry["strategy"])
            pipes, intervals = [], []
            for pipe in entry["pipelines"]:
                c = pipe["cost"]
                shape = PipeConfig(int(pipe["tp"]), int(pipe["pp"]), int(pipe.get("cp", 1)))
                model = PipeModel(shape, float(c["o"]),
                                  float(c["a"]), float(c["q"]), float(c["send_o"]),
                                  float(c["send_a"]), int(pipe["max_len"]),
                                  int(pipe.get("recompute_layers", 0)))  # fmt: skip
                pipes.append(PipeSpec(model, int(pipe["max_len"]), int(pipe["micro_batches"])))
                lo, hi = pipe["lengths"]
                intervals.append((int(lo), int(hi)))
            options = StrategyOptions(
                recompute=bool(entry.get("recompute", False)),
                recompute_layers=int(entry.get("recompute_layers", 0)),
                sequence_parallel=bool(entry.get("sequence_parallel", False)),
            )
            out.append(LengthStrategy(int(entry["max_len"]), tuple(pipes), tuple(intervals),
                                      float(entry["predicted_step_s"]), float(entry["sync_s"]),
                                      strategy, options))  # fmt: skip
            if len(strategy.pipelines) != len(pipes):
                raise ValueError(f"strategy {entry['strategy']!r} has not {len(pipes)} pipelines")
        switch = [[float(x) for x in row] for row in data["switch_s"]]
    except (KeyError, TypeError, ValueError, StrategyError) as error:
        raise LengthPlanError(f"{where}: bad plans file ({error})") from None
    if not out:
        raise LengthPlanError(f"{where}: no strategies")
    if len(switch) != len(out) or any(len(row) != len(out) for row in switch):
        raise LengthPlanError(f"{where}: switch_s is not {len(out)} x {len(out)}")
    return out, switch
