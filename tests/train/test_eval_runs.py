"""Held-out evaluations equal the reference's under every strategy.

An evaluation after every step (two batches of the last tenth of the corpus, forward only)
under DP, PP, TP, two heterogeneous pipelines, a switch between evaluations in both modes
(the second runs under the new strategy), ZeRO-1 with gradient accumulation and ZeRO-3
(gathered per layer in lock step, once per step otherwise): every
evaluation's loss within 1e-5 relative of the plain module's in eval mode, the steps'
losses too (an evaluation changes nothing of the training); bf16 compute within 1e-3. All
cases share one launch.
"""

from __future__ import annotations

from typing import Any

import pytest

from hspmd.train.api import revise, train_config
from hspmd.train.config import AdamConfig, EvalConfig
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import train_many

pytestmark = pytest.mark.multiproc

BASE = train_config(
    model_kwargs=(("num_layers", 2),), seq_len=16, global_batch=4, steps=2,
    adam=AdamConfig(lr=1e-3), evaluation=EvalConfig(every=1, batches=2, split=0.1),
    data_max_bytes=1 << 18,
)  # fmt: skip
HETERO = "2x1: R0-1:L0 R2:L1; 2x1: R3:L0-1"  # TP 2 then TP 1 beside a one-rank pipeline

CASES: dict[str, dict[str, Any]] = {
    "DP": dict(strategy="2x1: R0:L0-1; 2x1: R1:L0-1"),
    "PP": dict(strategy="4x1: R0:L0 R1:L1"),
    "TP": dict(strategy="4x1: R0-1:L0-1"),
    "heterogeneous two pipelines": dict(strategy=HETERO),
    "switch": dict(strategy="4x1: R0:L0 R1:L1", switches=((2, HETERO),)),
    # idle ranks hold home shards: they only join the evaluation's sum
    "switch (weights)": dict(strategy="4x1: R0:L0 R1:L1", switches=((2, HETERO),),
                             switch_mode="weights"),
    "ZeRO-1, accumulation": dict(strategy=HETERO, zero=1, grad_accum=2),
    # ZeRO-3: parameters gathered per layer (lock step) or once per step (heterogeneous)
    "ZeRO-3 DP": dict(strategy="2x1: R0:L0-1; 2x1: R1:L0-1", zero=3),
    "ZeRO-3 heterogeneous": dict(strategy=HETERO, zero=3),
    # bf16 compute weights against the fp32 reference, as tests/train/test_recipe_runs.py
    "bf16": dict(strategy=HETERO, dtype="bf16"),
}  # fmt: skip
RTOL = {"bf16": 1e-3}


@pytest.fixture(scope="module")
def runs() -> dict[str, TrainResult]:
    configs = [revise(BASE, **changes) for changes in CASES.values()]
    return dict(zip(CASES, train_many(configs, threads=1, timeout_s=600), strict=True))


@pytest.fixture(scope="module")
def references() -> dict[int, TrainResult]:
    return {n: run_reference(revise(BASE, grad_accum=n)) for n in (1, 2)}


@pytest.mark.parametrize("name", list(CASES))
def test_evaluations_equal_the_reference(
    runs: dict[str, TrainResult], references: dict[int, TrainResult], name: str
) -> None:
    result, reference = runs[name], references[CASES[name].get("grad_accum", 1)]
    assert [e.step for e in result.evaluations] == [1, 2]
    rel = RTOL.get(name, 1e-5)
    for got, want in zip(result.evaluations, reference.evaluations, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=rel), got.step
        assert got.tokens == want.tokens == 2 * 4 * 16
    for got, want in zip(result.records, reference.records, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=rel), got.step
