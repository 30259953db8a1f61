"""Shared pieces of the elastic tests: a tiny config, its reference, an elastic run."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hspmd.train.api import revise, train_config
from hspmd.train.config import AdamConfig, StepRecord
from hspmd.train.faults import parse_injections
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import train_elastic

# Every test trains this, under different strategies and failures: one reference.
BASE = train_config(
    model_kwargs=(("num_layers", 2),), seq_len=16, global_batch=8, adam=AdamConfig(lr=1e-3),
    steps=4, elastic=True, hang_timeout=10.0,  # hangs: test_hang.py sets its own
)  # fmt: skip
TIMEOUT_S = 120.0  # the launcher's bound on a whole run (a loaded 2-core machine)


@functools.cache
def reference(steps: int = BASE.steps) -> TrainResult:
    return run_reference(revise(BASE, elastic=False, steps=steps))


def run(
    strategy: str, *injections: str, on_step: Callable[[StepRecord], None] | None = None,
    on_start: Callable[[list[int]], None] | None = None, **changes: Any,
) -> tuple[TrainResult, list[dict[str, Any]]]:  # fmt: skip
    """An elastic run of ``BASE`` under ``strategy``; its result and its events."""
    config = revise(BASE, strategy=strategy, inject=parse_injections(injections), **changes)
    events: list[dict[str, Any]] = []

    def on_event(event: dict[str, Any]) -> None:
        events.append(event)
        if event["event"] == "started" and on_start is not None:
            on_start(event["pids"])

    result = train_elastic(
        config, on_step=on_step, on_event=on_event, timeout_s=TIMEOUT_S, threads=1
    )
    return result, events


def assert_matches_reference(result: TrainResult, *, steps: int = BASE.steps) -> None:
    """Every step once, in order, with the reference's loss; the final weights too."""
    ref = reference(steps)
    assert [r.step for r in result.records] == list(range(1, steps + 1))
    for mine, theirs in zip(result.records, ref.records, strict=True):
        assert abs(mine.loss - theirs.loss) <= 1e-5 * max(1.0, abs(theirs.loss)), (mine, theirs)
    for name, expected in ref.params.items():
        torch.testing.assert_close(result.params[name], expected, rtol=1e-5, atol=1e-5)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in events if e["event"] != "started"]
