"""Checkpoints in training: save under one strategy, resume under another, same numbers.

One launch runs the cases in order: each saving run stops after step 2 with a checkpoint;
the next run resumes it under a different strategy (and may switch later). The resumed
steps' losses and the final parameters equal the uninterrupted single-device reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hspmd.checkpoint import latest, read_manifest
from hspmd.train.api import revise, train_config
from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.identity import model_identity
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_many

pytestmark = pytest.mark.multiproc

BASE = train_config(
    model_kwargs=(("num_layers", 2),), seq_len=16, global_batch=4, adam=AdamConfig(lr=1e-3),
    steps=4,
)  # fmt: skip


def _cases(root: Path) -> dict[str, TrainConfig]:
    plain, zero = str(root / "plain"), str(root / "zero")
    return {
        "save PP": revise(
            BASE, strategy="2x2: R0:L0-0 R1:L1-1", steps=2, save=plain, save_every=2
        ),
        "resume TP, then switch to one rank": revise(
            BASE, strategy="4x1: R0-1:L0-1", resume=plain, switches=((4, "4x1: R0:L0-1"),)
        ),
        "save ZeRO-1": revise(
            BASE, strategy="2x1: R0:L0-1; 2x1: R1:L0-1", steps=2, save=zero, zero=1
        ),
        "resume ZeRO-1 on other replicas": revise(
            BASE, strategy="1x2: R0-1:L0-1; 1x2: R2:L0-0 R3:L1-1", resume=zero, zero=1,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, TrainConfig], dict[str, Any]]:
    cases = _cases(tmp_path_factory.mktemp("checkpoints"))
    results = train_many(list(cases.values()), threads=1, timeout_s=300)
    return cases, dict(zip(cases, results, strict=True))


@pytest.fixture(scope="module")
def reference() -> Any:
    return run_reference(revise(BASE, strategy=None))


def test_saving_run_writes_step_2(runs: Any) -> None:
    cases, _ = runs
    for name in ("save PP", "save ZeRO-1"):
        manifest = read_manifest(latest(cases[name].checkpoint.save))
        assert (manifest.step, manifest.adam_step, manifest.data_position) == (2, 2, 2)
        assert manifest.strategy == str(cases[name].strategy)
        assert manifest.identity == model_identity(BASE)  # a resume of another model: refused


@pytest.mark.parametrize(
    "name", ["resume TP, then switch to one rank", "resume ZeRO-1 on other replicas"]
)
def test_resume_on_another_strategy_continues_exactly(runs: Any, reference: Any, name: str) -> None:
    _, results = runs
    result = results[name]
    assert [r.step for r in result.records] == [3, 4]
    for got, want in zip(result.losses, reference.losses[2:], strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    for param, want in reference.params.items():
        diff = float((result.params[param] - want).norm() / want.norm())
        assert diff < 1e-4, (param, diff)


def test_saved_losses_match_reference(runs: Any, reference: Any) -> None:
    _, results = runs
    for name in ("save PP", "save ZeRO-1"):
        for got, want in zip(results[name].losses, reference.losses[:2], strict=True):
            assert got == pytest.approx(want, rel=1e-5)
