"""The comparison rule (``hspmd.train.compare``): fp32 noise in a parameter whose gradient
is zero in exact arithmetic passes, a parameter that missed its updates does not."""

from __future__ import annotations

import dataclasses

import torch

from hspmd.train.api import train_config
from hspmd.train.compare import compare
from hspmd.train.config import AdamConfig
from hspmd.train.reference import build_reference_model, run_reference

CONFIG = train_config(model_kwargs=(("num_layers", 1),), global_batch=2, seq_len=8, steps=3,
                     adam=AdamConfig(lr=1e-3))  # fmt: skip


def test_a_parameter_that_missed_its_updates_is_far_over_its_tolerance() -> None:
    reference = run_reference(CONFIG)
    initial = dict(build_reference_model(CONFIG).named_parameters())
    name = "layers.0.attn.wk.weight"
    stale = dataclasses.replace(
        reference, params={**reference.params, name: initial[name].detach().clone()}
    )
    report = compare(stale, reference, config=CONFIG)
    assert not report.ok and report.worst == name and report.score > 100, report
    assert compare(reference, reference, config=CONFIG).ok


def test_noise_the_size_of_a_tiny_parameter_passes_only_by_the_update_term() -> None:
    reference = run_reference(CONFIG)
    name = "layers.0.attn_norm.weight"
    tiny = torch.full_like(reference.params[name], 1e-7)  # a parameter near zero ...
    noisy = torch.full_like(tiny, -1e-7)  # ... two runs of fp32 noise apart
    want = dataclasses.replace(reference, params={**reference.params, name: tiny})
    got = dataclasses.replace(reference, params={**reference.params, name: noisy})
    assert compare(got, want, config=CONFIG).ok  # 1e-3 x lr x 3 steps x sqrt(n) >> 2e-7 x sqrt(n)
    assert not compare(got, want).ok  # relative alone: 200% of its norm
