"""The gradient elements the reference only ever saw as fp32 noise.

Some gradients are zero in exact arithmetic and yet not zero in fp32: a key bias (or the
part of it that RoPE does not rotate) shifts every score of a query by the same amount,
which the softmax ignores; with documents of one repeated token every value of a document
is the same, so no query or key weight gets a gradient either. What fp32 computes for such
an element is rounding error, about 4e-11 to 5e-10 of the step's largest gradient element
(measured: docs/cli.md, "Equal to the reference: the rule"), and it depends on the order
of the sums, which a distributed run changes. Adam then divides that noise by ``eps`` and
moves the element by up to ``lr`` a step in a direction no two runs share.

``NoiseFloor`` watches the reference's gradients step by step and keeps, per parameter,
the elements whose gradient stayed at or below the step's floor at every step without
being exactly zero at every step (an exact zero, such as the embedding row of a token the
step does not hold, is structure, not noise: Adam leaves it in place in both runs)::

    floor_t = u x max |g_t|        (u = 2^-24, fp32's unit roundoff)

The floor is the normwise precision of the step's gradient: fp32 carries any gradient
vector to a relative accuracy no better than ``u`` of its largest element, so an element
below ``u x max |g_t|`` has no digit the arithmetic vouches for. The noise measured sits
two to three decades below the floor; the smallest real gradients measured (a slowly
rotating RoPE pair of a key bias, single weights crossing zero) sit around it, and those
are the elements whose Adam step is noise-dominated anyway (their gradient is near
``eps``). ``hspmd.train.compare`` does not call such elements equal or different: it holds
them only to Adam's reach.

>>> import torch
>>> floor = NoiseFloor()
>>> floor.observe({"w": torch.tensor([1.0, 0.5, 0.0]), "b": torch.tensor([1e-12, 0.0, 2e-3])})
>>> floor.observe({"w": torch.tensor([0.8, 1e-9, 0.0]), "b": torch.tensor([-3e-12, 0.0, 1e-3])})
>>> floor.masks()  # b[0]: noise twice; w[2], b[1]: exact zeros; w[1]: once a real gradient
{'b': tensor([ True, False, False])}
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["UNIT_ROUNDOFF", "NoiseFloor"]

UNIT_ROUNDOFF = 2.0**-24  # fp32: half the distance from 1.0 to the next float


class NoiseFloor:
    """Per parameter name, which elements stayed at the noise floor (module docstring)."""

    def __init__(self) -> None:
        self._below: dict[str, torch.Tensor] = {}  # at or below the floor at every step
        self._moved: dict[str, torch.Tensor] = {}  # not exactly zero at some step

    def observe(self, grads: Mapping[str, torch.Tensor]) -> None:
        """One step's gradients (before clipping, which scales them all alike; a parameter
        missing from ``grads`` had none: an exact zero)."""
        magnitudes = {name: g.detach().abs() for name, g in grads.items() if g.numel()}
        if not magnitudes:
            return
        floor = torch.stack([m.max().float() for m in magnitudes.values()]).max() * UNIT_ROUNDOFF
        for name, m in magnitudes.items():
            below, moved = m <= floor, m > 0
            if name in self._below:
                self._below[name] &= below
                self._moved[name] |= moved
            else:
                self._below[name], self._moved[name] = below, moved

    def masks(self) -> dict[str, torch.Tensor]:
        """Name -> boolean mask (on CPU) of the noise-only elements, for the parameters that
        have any."""
        found = {name: (self._below[name] & self._moved[name]).cpu() for name in self._below}
        return {name: mask for name, mask in found.items() if bool(mask.any())}
