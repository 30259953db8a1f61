"""Compare a run with the reference: loss per step and parameters at the end.

Losses: ``|loss - ref| / |ref|`` per step, at most ``LOSS_RTOL``; the held-out
evaluations' losses likewise, by step (a run that evaluates after other steps differs).
Parameters: each one's difference ``||p - ref||`` within its own tolerance, scaled to the
parameter and to how far the optimizer could move it in the run (docs/runtime.md, "Equal
to the reference")::

    tolerance(p) = max(PARAM_RTOL x ||ref||,  UPDATE_RTOL x lr x steps x sqrt(numel))

Adam moves an element by about ``lr`` a step at most, so the second term is a hundredth
of the largest distance the run could move ``p``. It matters for a parameter whose gradient
is zero in exact arithmetic (GPT-2's key bias: the softmax ignores it): its updates are
fp32 noise that Adam scales up by ``1 / eps``, so its norm and its change over the run
(both about 1e-6) are as large as its difference between two runs (measured up to 3.4e-3
of ``lr x steps x sqrt(numel)``: OPT's and GPT-NeoX's key biases under TP), while a wrong
gradient moves it by a good fraction of ``lr x steps x sqrt(numel)``. Without ``config`` the second
term is 0: relative differences only.

>>> import torch
>>> from hspmd.train.config import AdamConfig, StepRecord
>>> rec = lambda loss: StepRecord(step=1, loss=loss, tokens=8, seconds=0.1)
>>> a = TrainResult((rec(2.0),), {"w": torch.ones(4), "b": torch.full((4,), 2.5e-7)})
>>> b = TrainResult((rec(2.0 + 2e-7),), {"w": torch.ones(4), "b": torch.full((4,), -2.5e-7)})
>>> print(compare(a, b))  # no config: b differs by twice its norm
losses 1.0e-07 (relative, over 1 steps); parameters 2.0e+04 of their tolerance (b: difference 1.0e-06, tolerance 5.0e-11): DIFFERENT from the reference
>>> print(compare(a, b, config=TrainConfig(adam=AdamConfig(lr=1e-4))))
losses 1.0e-07 (relative, over 1 steps); parameters 5.0e-01 of their tolerance (b: difference 1.0e-06, tolerance 2.0e-06): equal to the reference
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hspmd.train.config import TrainConfig
from hspmd.train.reference import TrainResult

__all__ = ["LOSS_RTOL", "PARAM_RTOL", "UPDATE_RTOL", "Comparison", "compare"]

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4
UPDATE_RTOL = 1e-2


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """``max_loss_rel``: the largest relative loss difference; ``score``: the largest
    parameter difference over its tolerance (``worst``: that parameter, ``difference`` and
    ``tolerance``: its figures); ``max_param_rel`` and ``worst_param``: the largest
    relative parameter difference, as reported before tolerances had two terms."""

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

    @property
    def ok(self) -> bool:
        losses = max(self.max_loss_rel, self.max_eval_rel)
        return losses <= LOSS_RTOL and self.score <= 1.0

    def __str__(self) -> str:
        verdict = "equal to the reference" if self.ok else "DIFFERENT from the reference"
        evals = (
            f"; evaluation losses {self.max_eval_rel:.1e} (relative, over {self.evaluations})"
            if self.evaluations or self.max_eval_rel
            else ""
        )
        return (
            f"losses {self.max_loss_rel:.1e} (relative, over {self.steps} steps){evals}; "
            f"parameters {self.score:.1e} of their tolerance ({self.worst}: difference "
            f"{self.difference:.1e}, tolerance {self.tolerance:.1e}): {verdict}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "max_loss_rel": self.max_loss_rel, "steps": self.steps,
            "param_score": self.score, "worst_param": self.worst,
            "param_difference": self.difference, "param_tolerance": self.tolerance,
            "max_param_rel": self.max_param_rel, "worst_relative_param": self.worst_param,
            "max_eval_rel": self.max_eval_rel, "evaluations": self.evaluations,
        }  # fmt: skip


def compare(
    result: TrainResult, reference: TrainResult, *, config: TrainConfig | None = None
) -> Comparison:
    """``result`` against ``reference`` (module docstring); ``config``: the run's, whose
    learning rate and step count scale the update term of the parameters' tolerance."""
    losses = [abs(a - b) / abs(b) for a, b in zip(result.losses, reference.losses, strict=True)]
    moved = config.adam.lr * len(losses) if config is not None else 0.0  # per element
    score, worst = -1.0, ("-", 0.0, 0.0)
    rel, rel_name = -1.0, "-"
    for name, want in reference.params.items():
        want = want.detach()
        difference = float((result.params[name] - want).norm())
        norm = float(want.norm())
        tolerance = max(PARAM_RTOL * norm, UPDATE_RTOL * moved * math.sqrt(want.numel()))
        here = difference / tolerance if tolerance > 0 else (0.0 if difference == 0 else math.inf)
        if here >= score:
            score, worst = here, (name, difference, tolerance)
        relative = difference / norm if norm > 0 else (0.0 if difference == 0 else math.inf)
        if relative >= rel:
            rel, rel_name = relative, name
    return Comparison(
        max_loss_rel=max(losses), steps=len(losses), score=max(score, 0.0), worst=worst[0],
        difference=worst[1], tolerance=worst[2], max_param_rel=max(rel, 0.0),
        worst_param=rel_name, max_eval_rel=_eval_difference(result, reference),
        evaluations=len(reference.evaluations),
    )  # fmt: skip


def _eval_difference(result: TrainResult, reference: TrainResult) -> float:
    """The largest relative difference of the evaluation losses, step by step (inf where
    the two evaluated after different steps)."""
    got = {e.step: e.loss for e in result.evaluations}
    want = {e.step: e.loss for e in reference.evaluations}
    if got.keys() != want.keys():
        return math.inf
    return max((abs(got[s] - want[s]) / abs(want[s]) for s in want), default=0.0)
