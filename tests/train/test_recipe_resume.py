"""The recipe across a checkpoint: save after step 2, resume under another strategy, and the
resumed steps equal the uninterrupted reference (losses, gradient norms, learning rates,
parameters).

The schedule's position is the checkpoint's Adam step and the learning rate a function of
it alone; clipping keeps no state. The saving run stops at step 2 of a 4-step schedule, so
it names the schedule's horizon (``decay_steps=4``) instead of taking its own ``--steps``.
"""

from __future__ import annotations

import dataclasses

import pytest

from hspmd.checkpoint import latest, read_manifest
from hspmd.cli.train import resume_warnings
from hspmd.train.api import revise, train_config
from hspmd.train.config import AdamConfig
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import train_many

pytestmark = pytest.mark.multiproc

RECIPE = AdamConfig(lr=1e-3, beta2=0.95, weight_decay=0.1, lr_schedule="linear",
                    warmup_steps=1, decay_steps=4, min_lr=1e-4)  # fmt: skip
BASE = train_config(
    model_kwargs=(("num_layers", 2),), seq_len=16, global_batch=4, steps=4, adam=RECIPE,
    clip_grad_norm=1.0, grad_accum=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[TrainResult]]:
    folder = str(tmp_path_factory.mktemp("recipe") / "ckpt")
    save = revise(BASE, strategy="2x1: R0-1:L0 R2:L1; 2x1: R3:L0-1", steps=2,
                               save=folder)  # fmt: skip
    resume = revise(BASE, strategy="1x2: R0:L0-1; 1x2: R1-2:L0-1", zero=1,
                                 resume=folder)  # fmt: skip
    return folder, train_many([save, resume], threads=1, timeout_s=600)


@pytest.fixture(scope="module")
def reference() -> TrainResult:
    return run_reference(BASE)


def test_resumed_recipe_continues_exactly(
    runs: tuple[str, list[TrainResult]], reference: TrainResult
) -> None:
    _, (saved, resumed) = runs
    assert [r.step for r in resumed.records] == [3, 4]
    for got, want in zip(saved.records + resumed.records, reference.records, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=1e-5), got.step
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5), got.step
        assert got.lr == want.lr, got.step
    for param, want in reference.params.items():
        diff = float((resumed.params[param] - want).norm() / want.norm())
        assert diff < 1e-4, (param, diff)


def test_checkpoint_records_the_recipe_and_a_different_one_warns(
    runs: tuple[str, list[TrainResult]],
) -> None:
    folder, _ = runs
    manifest = read_manifest(latest(folder))
    assert (manifest.step, manifest.adam_step) == (2, 2)
    assert manifest.run["--lr-schedule"] == "linear" and manifest.run["--decay-steps"] == 4
    assert manifest.run["--clip-grad-norm"] == 1.0 and manifest.run["--grad-accum"] == 2
    same = revise(BASE, strategy="4x1: R0:L0-1", resume=folder)
    assert resume_warnings(same) == []
    # the default horizon is --steps, 4 here as the saved one: no change
    assert (
        resume_warnings(revise(same, adam=dataclasses.replace(same.adam, decay_steps=None))) == []
    )
    other = revise(same, adam=dataclasses.replace(same.adam, lr_schedule="cosine"))
    (warning,) = resume_warnings(other)
    assert warning.startswith(
        "resuming with --lr-schedule cosine where the checkpoint was saved with linear"
    )
