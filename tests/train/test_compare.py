"""The comparison rule (``hspmd.train.compare``): fp32 noise in a parameter whose gradient
is zero in exact arithmetic passes, a parameter that missed its updates does not; the
elements whose gradient the reference only saw as noise (``hspmd.train.noise_floor``) are
held to Adam's reach only, the rest of their parameter is judged as before."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hspmd.models.examples import gpt2
from hspmd.train.api import train_config
from hspmd.train.compare import compare
from hspmd.train.config import AdamConfig
from hspmd.train.reference import TrainResult, build_reference_model, run_reference

CONFIG = train_config(model_kwargs=(("num_layers", 1),), global_batch=2, seq_len=8, steps=3,
                     adam=AdamConfig(lr=1e-3))  # fmt: skip
# the GPT-2 example (a key bias: its gradient is zero in exact arithmetic), one layer
GPT2 = train_config(model=gpt2, model_kwargs=(("num_layers", 1), ("tie", False)),
                    global_batch=2, seq_len=8, steps=3, adam=AdamConfig(lr=1e-3))  # fmt: skip
KEY_BIAS, QUERY_BIAS = "layers.0.attn.k.bias", "layers.0.attn.q.bias"
REACH = GPT2.adam.lr * GPT2.steps  # the furthest Adam moves an element, about


@pytest.fixture(scope="module")
def reference() -> TrainResult:
    return run_reference(CONFIG)


@pytest.fixture(scope="module")
def gpt2_reference() -> TrainResult:
    return run_reference(GPT2)


def _with(result: TrainResult, **params: torch.Tensor) -> TrainResult:
    return dataclasses.replace(result, params={**result.params, **params})


def test_a_parameter_that_missed_its_updates_is_far_over_its_tolerance(
    reference: TrainResult,
) -> None:
    initial = dict(build_reference_model(CONFIG).named_parameters())
    name = "layers.0.attn.wk.weight"
    stale = _with(reference, **{name: initial[name].detach().clone()})
    report = compare(stale, reference, config=CONFIG)
    assert not report.ok and report.worst == name and report.score > 100, report
    assert compare(reference, reference, config=CONFIG).ok


def test_noise_the_size_of_a_tiny_parameter_passes_only_by_the_update_term(
    reference: TrainResult,
) -> None:
    name = "layers.0.attn_norm.weight"
    tiny = torch.full_like(reference.params[name], 1e-7)  # a parameter near zero ...
    noisy = torch.full_like(tiny, -1e-7)  # ... two runs of fp32 noise apart
    want, got = _with(reference, **{name: tiny}), _with(reference, **{name: noisy})
    assert compare(got, want, config=CONFIG).ok  # 1e-3 x lr x 3 steps x sqrt(n) >> 2e-7 x sqrt(n)
    assert not compare(got, want).ok  # relative alone: 200% of its norm


def test_the_floor_finds_the_key_bias_and_nothing_else(
    gpt2_reference: TrainResult, reference: TrainResult
) -> None:
    """The softmax ignores a key bias: every element of it, and only it, is noise-only
    (the embedding rows of bytes the steps do not hold are exact zeros: judged)."""
    masks = gpt2_reference.noise_only
    assert list(masks) == [KEY_BIAS] and bool(masks[KEY_BIAS].all()), masks
    assert reference.noise_only == {}  # Llama: no bias, every gradient real


def test_adam_noise_in_a_noise_only_element_passes_a_real_gradient_does_not(
    gpt2_reference: TrainResult,
) -> None:
    """Another summation order gives a zero-gradient element another Adam trajectory, up to
    ``lr`` a step: a fraction of the reach apart. The same on a bias with a real gradient
    is a wrong result."""
    ref = gpt2_reference
    signs = torch.randn(ref.params[KEY_BIAS].shape, generator=torch.Generator().manual_seed(0))
    shift = 0.3 * REACH * signs.sign()
    noisy = _with(ref, **{KEY_BIAS: ref.params[KEY_BIAS] + shift})
    report = compare(noisy, ref, config=GPT2)
    assert report.ok and report.noise is not None, report
    assert report.noise.parameters == (KEY_BIAS,) and report.noise.elements == shift.numel()
    assert math.isclose(report.noise.largest, 0.3 * REACH, rel_tol=1e-3)
    assert "noise-only elements in 1 parameter, not judged" in str(report)
    unmasked = dataclasses.replace(ref, noise_only={})
    assert not compare(noisy, unmasked, config=GPT2).ok  # the rule before: 300x over
    wrong = _with(noisy, **{QUERY_BIAS: ref.params[QUERY_BIAS] + shift})
    report = compare(wrong, ref, config=GPT2)
    assert not report.ok and report.worst == QUERY_BIAS and report.score > 10, report


def test_a_parameter_partly_noise_only_is_judged_on_the_rest(
    gpt2_reference: TrainResult,
) -> None:
    """Phi's key bias: RoPE rotates half of each head's elements (a real gradient), the
    other half only shifts the scores (noise): a difference in the first half is caught."""
    ref = gpt2_reference
    half = torch.arange(ref.params[QUERY_BIAS].numel()) % 2 == 0
    partly = dataclasses.replace(ref, noise_only={**ref.noise_only, QUERY_BIAS: half})
    shift = 0.3 * REACH * torch.ones_like(ref.params[QUERY_BIAS])
    on_noise = _with(ref, **{QUERY_BIAS: ref.params[QUERY_BIAS] + shift * half})
    on_rest = _with(ref, **{QUERY_BIAS: ref.params[QUERY_BIAS] + shift * ~half})
    assert compare(on_noise, partly, config=GPT2).ok
    report = compare(on_rest, partly, config=GPT2)
    assert not report.ok and report.worst == QUERY_BIAS, report


def test_noise_only_elements_beyond_adams_reach_or_nan_are_different(
    gpt2_reference: TrainResult,
) -> None:
    ref = gpt2_reference
    far = _with(ref, **{KEY_BIAS: ref.params[KEY_BIAS] + 10 * REACH})  # no Adam goes there
    report = compare(far, ref, config=GPT2)
    assert not report.ok and report.score <= 1.0 and report.noise is not None
    assert not report.noise.ok and "BEYOND" in str(report), report
    nan = ref.params[KEY_BIAS].clone()
    nan[0] = math.nan
    report = compare(_with(ref, **{KEY_BIAS: nan}), ref, config=GPT2)
    assert not report.ok and report.to_json()["noise_only"]["ok"] is False, report
    judged_nan = ref.params[QUERY_BIAS].clone()
    judged_nan[0] = math.nan
    assert not compare(_with(ref, **{QUERY_BIAS: judged_nan}), ref, config=GPT2).ok


def test_bf16_compute_is_judged_by_the_bf16_rule(reference: TrainResult) -> None:
    """bf16 rounding (a 1e-2 relative drift of one weight, a 1e-4 one of the losses) is
    DIFFERENT under the fp32 rule and equal under the bf16 one; a stale weight is
    DIFFERENT under both."""
    from hspmd.train.api import revise

    bf16 = revise(CONFIG, dtype="bf16")
    name = "layers.0.attn.wk.weight"
    drifted = _with(reference, **{name: reference.params[name] * (1 + 1e-2)})
    records = tuple(dataclasses.replace(r, loss=r.loss * (1 + 1e-4)) for r in reference.records)
    drifted = dataclasses.replace(drifted, records=records)
    assert not compare(drifted, reference, config=CONFIG).ok
    report = compare(drifted, reference, config=bf16)
    assert report.ok and report.to_json()["rule"] == "bf16" and "(bf16 rule)" in str(report)
    initial = dict(build_reference_model(CONFIG).named_parameters())
    stale = _with(reference, **{name: initial[name].detach().clone()})
    assert not compare(stale, reference, config=bf16).ok
