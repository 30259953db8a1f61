"""The full recipe in elastic runs: a killed rank changes no number.

AdamW with weight decay, a cosine schedule after warm-up, clipping at a norm every step
exceeds, and two accumulated global batches per step. A rank killed as the step's sync
begins (the norm's all-reduce is then waited on, watched, by the others) makes the step
redone under the re-planned strategy; one killed after the commit leaves the step applied
once (the survivors that had not applied it apply the gradients they had clipped). Every
step's loss, gradient norm and learning rate, and the final weights, equal the reference.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from hspmd.train.api import revise
from hspmd.train.config import AdamConfig
from hspmd.train.reference import TrainResult, run_reference
from tests.elastic.helpers import BASE, kinds, run

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]

HETERO = "2x2: R0:L0-0 R1:L1-1; 2x2: R2-3:L0-1"  # a PP pipeline and a TP pipeline
RECIPE: dict[str, Any] = dict(
    adam=AdamConfig(lr=1e-3, beta2=0.95, weight_decay=0.1, lr_schedule="cosine",
                    warmup_steps=1, min_lr=1e-4),
    clip_grad_norm=1.0, grad_accum=2,
)  # fmt: skip


@functools.cache
def _reference() -> TrainResult:
    return run_reference(revise(BASE, elastic=False, **RECIPE))


def _check(result: TrainResult) -> None:
    reference = _reference()
    assert [r.step for r in result.records] == list(range(1, BASE.steps + 1))
    for got, want in zip(result.records, reference.records, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=1e-5), got.step
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5), got.step
        assert got.lr == want.lr, got.step
    assert all(r.grad_norm is not None and r.grad_norm > 1.0 for r in reference.records)
    for name, expected in reference.params.items():
        torch.testing.assert_close(result.params[name], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("injection", "redone"), [("1@2:sync", 2), ("3@2:optimizer", 3)])
def test_recipe_survives_a_kill(injection: str, redone: int) -> None:
    result, events = run(HETERO, injection, **RECIPE)
    _check(result)
    assert kinds(events) == ["failure", "replan", "resumed"]
    assert next(e for e in events if e["event"] == "resumed")["step"] == redone
