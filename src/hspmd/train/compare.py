"""Compare a run with the reference: loss per step and parameters at the end.

Losses: ``|loss - ref| / |ref|`` per step, at most ``LOSS_RTOL``; the held-out
evaluations' losses likewise, by step (a run that evaluates after other steps differs).
Parameters: each one's difference ``||p - ref||`` within its own tolerance, scaled to the
parameter and to how far the optimizer could move it in the run (docs/runtime.md, "Equal
to the reference")::

    tolerance(p) = max(PARAM_RTOL x ||ref||,  UPDATE_RTOL x lr x steps x sqrt(numel))

Adam moves an element by about ``lr`` a step at most, so the second term is a thousandth
of the largest distance the run could move ``p``: a parameter near zero is not held to a
relative difference of its own tiny norm. Without ``config`` the second term is 0:
relative differences only. Under bf16 compute (``config.options.dtype``) the constants are
``BF16``'s, the bounds the bf16 equality tests hold, and the verdict says so.

Noise-only elements are not judged equal or different: those whose gradient, in the
reference, stayed at fp32's noise floor at every step (``reference.noise_only``, found by
``hspmd.train.noise_floor``; a key bias's, which the softmax ignores). Their gradient is
rounding error that depends on the order of the sums, and Adam divides it by ``eps`` into
steps up to ``lr`` in directions no two runs share, so nothing about them can be equal.
They are held only to Adam's reach, a bound no correct run exceeds::

    |p - ref| <= 2 x lr x sum over steps t of adam_step_bound(t)

(each run's step t moves an element by at most ``lr x adam_step_bound(t)``, whatever the
gradients: 1 at step 1, 7.3 at most for betas 0.9/0.999; two runs apart twice that). A
NaN anywhere is different.

>>> import torch
>>> from hspmd.train.config import AdamConfig, StepRecord
>>> rec = lambda loss: StepRecord(step=1, loss=loss, tokens=8, seconds=0.1)
>>> a = TrainResult((rec(2.0),), {"w": torch.ones(4), "b": torch.full((4,), 2.5e-7)})
>>> b = TrainResult((rec(2.0 + 2e-7),), {"w": torch.ones(4), "b": torch.full((4,), -2.5e-7)})
>>> print(compare(a, b))  # no config: b differs by twice its norm
losses 1.0e-07 (relative, over 1 steps); parameters 2.0e+04 of their tolerance (b: difference 1.0e-06, tolerance 5.0e-11): DIFFERENT from the reference
>>> print(compare(a, b, config=TrainConfig(adam=AdamConfig(lr=1e-3))))
losses 1.0e-07 (relative, over 1 steps); parameters 5.0e-01 of their tolerance (b: difference 1.0e-06, tolerance 2.0e-06): equal to the reference
>>> import dataclasses
>>> noisy = dataclasses.replace(b, noise_only={"b": torch.tensor([True, True, False, False])})
>>> print(compare(a, noisy))  # b's first two elements: noise in the reference
losses 1.0e-07 (relative, over 1 steps); parameters 2.0e+04 of their tolerance (b: difference 7.1e-07, tolerance 3.5e-11); 2 noise-only elements in 1 parameter, not judged: at most 5.0e-07 apart (Adam's reach: inf): DIFFERENT from the reference
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.reference import TrainResult

__all__ = [
    "BF16", "FP32", "LOSS_RTOL", "PARAM_RTOL", "UPDATE_RTOL", "Comparison", "NoiseOnly",
    "Tolerances", "adam_step_bound", "compare",
]  # fmt: skip

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4
UPDATE_RTOL = 1e-3


@dataclass(frozen=True, slots=True)
class Tolerances:
    """The rule's three constants (module docstring), per compute dtype."""

    loss: float
    param: float
    update: float
    name: str


FP32 = Tolerances(LOSS_RTOL, PARAM_RTOL, UPDATE_RTOL, "fp32")
# bf16 compute (fp32 masters): the run and the reference round every matmul to 8 bits of
# mantissa in different orders; the bounds the bf16 equality tests have always held
# (tests/train/test_strategy_matrix.py), measured at 4.8e-5 to 7.7e-5 for losses and 0.27 of
# the update term on HF Llama and llama-tiny under TP 2 (3 steps)
BF16 = Tolerances(1e-3, 5e-2, 5e-2, "bf16")


@dataclass(frozen=True, slots=True, kw_only=True)
class NoiseOnly:
    """The noise-only elements (module docstring): how many, in which parameters, the
    largest ``|p - ref|`` among them and Adam's reach (inf without the run's config)."""

    elements: int
    parameters: tuple[str, ...]
    largest: float
    reach: float

    @property
    def ok(self) -> bool:
        return self.largest <= self.reach  # False for NaN

    def __str__(self) -> str:
        within = "" if self.ok else ", BEYOND it"
        params = f"{len(self.parameters)} parameter" + ("s" if len(self.parameters) > 1 else "")
        return (
            f"{self.elements} noise-only elements in {params}, not judged: at most "
            f"{self.largest:.1e} apart (Adam's reach: {self.reach:.1e}{within})"
        )

    def to_json(self) -> dict[str, Any]:
        return {"elements": self.elements, "parameters": list(self.parameters),
                "max_difference": self.largest, "ok": self.ok,
                "reach": self.reach if math.isfinite(self.reach) else None}  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """``max_loss_rel``: the largest relative loss difference; ``score``: the largest
    parameter difference over its tolerance (``worst``: that parameter, ``difference`` and
    ``tolerance``: its figures; noise-only elements left out); ``max_param_rel`` and
    ``worst_param``: the largest relative parameter difference, as reported before
    tolerances had two terms; ``noise``: the noise-only elements (None: there are none)."""

    max_loss_rel: float
    steps: int
    score: float
    worst: str
    difference: float
    tolerance: float
    max_param_rel: float
    worst_param: str
    max_eval_rel: float = 0.0  # the largest relative difference of evaluation losses
    evaluations: int = 0
    noise: NoiseOnly | None = None
    rule: Tolerances = FP32

    @property
    def ok(self) -> bool:
        losses = max(self.max_loss_rel, self.max_eval_rel)
        noise = self.noise is None or self.noise.ok
        return losses <= self.rule.loss and self.score <= 1.0 and noise

    def __str__(self) -> str:
        verdict = "equal to the reference" if self.ok else "DIFFERENT from the reference"
        evals = (
            f"; evaluation losses {self.max_eval_rel:.1e} (relative, over {self.evaluations})"
            if self.evaluations or self.max_eval_rel
            else ""
        )
        noise = f"; {self.noise}" if self.noise is not None else ""
        rule = " (bf16 rule)" if self.rule is BF16 else ""
        return (
            f"losses {self.max_loss_rel:.1e} (relative, over {self.steps} steps){evals}; "
            f"parameters {self.score:.1e} of their tolerance ({self.worst}: difference "
            f"{self.difference:.1e}, tolerance {self.tolerance:.1e}){noise}: {verdict}{rule}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "max_loss_rel": self.max_loss_rel, "steps": self.steps,
            "param_score": self.score, "worst_param": self.worst,
            "param_difference": self.difference, "param_tolerance": self.tolerance,
            "max_param_rel": self.max_param_rel, "worst_relative_param": self.worst_param,
            "max_eval_rel": self.max_eval_rel, "evaluations": self.evaluations,
            "noise_only": self.noise.to_json() if self.noise is not None else None,
            "rule": self.rule.name,
        }  # fmt: skip


def compare(
    result: TrainResult, reference: TrainResult, *, config: TrainConfig | None = None
) -> Comparison:
    """``result`` against ``reference`` (module docstring); ``config``: the run's, whose
    learning rate and step count scale the update term of the parameters' tolerance and
    Adam's reach for the noise-only elements (``reference.noise_only``)."""
    losses = [abs(a - b) / abs(b) for a, b in zip(result.losses, reference.losses, strict=True)]
    moved = config.adam.lr * len(losses) if config is not None else 0.0  # per element
    rule = BF16 if config is not None and config.options.dtype == "bf16" else FP32
    score, worst = -1.0, ("-", 0.0, 0.0)
    rel, rel_name = -1.0, "-"
    for name, want in reference.params.items():
        got, want = _judged(result.params[name], want, reference.noise_only.get(name))
        if want.numel() == 0:  # every element is noise-only
            continue
        difference, norm = float((got - want).norm()), float(want.norm())
        tolerance = max(rule.param * norm, rule.update * moved * math.sqrt(want.numel()))
        if (here := _ratio(difference, tolerance)) >= score:
            score, worst = here, (name, difference, tolerance)
        if (relative := _ratio(difference, norm)) >= rel:
            rel, rel_name = relative, name
    return Comparison(
        max_loss_rel=max(losses), steps=len(losses), score=max(score, 0.0), worst=worst[0],
        difference=worst[1], tolerance=worst[2], max_param_rel=max(rel, 0.0),
        worst_param=rel_name, max_eval_rel=_eval_difference(result, reference),
        evaluations=len(reference.evaluations), noise=_noise_only(result, reference, config),
        rule=rule,
    )  # fmt: skip


def _judged(
    got: torch.Tensor, want: torch.Tensor, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements of a parameter that the rule judges: all but the noise-only ones."""
    got, want = got.detach().flatten(), want.detach().flatten()
    if noise is None:
        return got, want
    keep = ~noise.flatten()
    return got[keep], want[keep]


def _ratio(difference: float, scale: float) -> float:
    """``difference / scale``: 0 for no difference, inf for a NaN or one over a zero."""
    if math.isnan(difference):
        return math.inf
    return difference / scale if scale > 0 else (0.0 if difference == 0 else math.inf)


def _noise_only(
    result: TrainResult, reference: TrainResult, config: TrainConfig | None
) -> NoiseOnly | None:
    """The noise-only elements' figures (None when the reference has none)."""
    if not reference.noise_only:
        return None
    apart = [
        (result.params[name].detach() - reference.params[name].detach())[mask].abs().max()
        for name, mask in reference.noise_only.items()
    ]
    largest = float(torch.stack(apart).max())  # NaN when any is (torch's max keeps NaN)
    reach = math.inf
    if config is not None:  # two runs, each within lr x adam_step_bound a step
        steps = range(1, len(reference.records) + 1)
        reach = 2 * config.adam.lr * sum(adam_step_bound(config.adam, t) for t in steps)
    return NoiseOnly(
        elements=sum(int(m.sum()) for m in reference.noise_only.values()),
        parameters=tuple(reference.noise_only), largest=largest, reach=reach,
    )  # fmt: skip


def adam_step_bound(adam: AdamConfig, step: int) -> float:
    """The most Adam's step ``step`` can move an element, over ``lr`` (any gradients;
    ``eps`` and decoupled weight decay only shrink it): ``|m_hat| / sqrt(v_hat)`` by
    Cauchy-Schwarz over the gradients' weights in the two averages.

    >>> a = AdamConfig()
    >>> adam_step_bound(a, 1), round(adam_step_bound(a, 2), 3), round(adam_step_bound(a, 10**4), 2)
    (1.0, 1.001, 7.27)
    """
    b1, b2 = adam.beta1, adam.beta2
    ratio = b1 * b1 / b2
    terms = float(step) if ratio == 1 else (1 - ratio**step) / (1 - ratio)
    first = (1 - b1) ** 2 / (1 - b1**step) ** 2
    second = (1 - b2**step) / (1 - b2)
    return math.sqrt(first * second * terms)


def _eval_difference(result: TrainResult, reference: TrainResult) -> float:
    """The largest relative difference of the evaluation losses, step by step (inf where
    the two evaluated after different steps)."""
    got = {e.step: e.loss for e in result.evaluations}
    want = {e.step: e.loss for e in reference.evaluations}
    if got.keys() != want.keys():
        return math.inf
    return max((abs(got[s] - want[s]) / abs(want[s]) for s in want), default=0.0)
