"""Compare a run with the reference: loss per step and parameters at the end.

>>> import torch
>>> from hspmd.train.config import StepRecord
>>> rec = lambda loss: StepRecord(step=1, loss=loss, tokens=8, seconds=0.1)
>>> a = TrainResult((rec(2.0),), {"w": torch.ones(2)})
>>> b = TrainResult((rec(2.0 + 2e-7),), {"w": torch.ones(2)})
>>> print(compare(a, b))
max relative loss difference 1.0e-07 over 1 steps; max relative parameter difference 0.0e+00 (w): equal to the reference (fp32 tolerances 1e-05 / 1e-04)
"""

from __future__ import annotations

from dataclasses import dataclass

from hspmd.train.reference import TrainResult

__all__ = ["Comparison", "compare"]

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4


@dataclass(frozen=True, slots=True)
class Comparison:
    max_loss_rel: float
    max_param_rel: float
    worst_param: str
    steps: int

    @property
    def ok(self) -> bool:
        return self.max_loss_rel <= LOSS_RTOL and self.max_param_rel <= PARAM_RTOL

    def __str__(self) -> str:
        verdict = "equal to the reference" if self.ok else "DIFFERENT from the reference"
        return (
            f"max relative loss difference {self.max_loss_rel:.1e} over {self.steps} steps; "
            f"max relative parameter difference {self.max_param_rel:.1e} ({self.worst_param}): "
            f"{verdict} (fp32 tolerances {LOSS_RTOL:.0e} / {PARAM_RTOL:.0e})"
        )


def compare(result: TrainResult, reference: TrainResult) -> Comparison:
    """Relative differences: |loss - ref| / |ref| per step; ||p - ref|| / ||ref|| per param."""
    losses = [abs(a - b) / abs(b) for a, b in zip(result.losses, reference.losses, strict=True)]
    worst, worst_name = 0.0, "-"
    for name, want in reference.params.items():
        got = result.params[name]
        error = float((got - want.detach()).norm() / want.detach().norm())
        if error >= worst:
            worst, worst_name = error, name
    return Comparison(max(losses), worst, worst_name, len(losses))
