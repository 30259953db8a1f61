"""A plain per-tensor Adam whose numbers equal ``torch.optim.Adam`` elementwise.

Adam is elementwise, so running it on any slice of a parameter (with the matching slice
of the gradient) gives exactly that slice of the full update: each rank steps only its
local pieces and the result equals single-device training. The arithmetic mirrors
torch's single-tensor implementation operation by operation, so results are bitwise
equal to ``torch.optim.Adam(foreach=False)``.

>>> import torch
>>> p = torch.ones(3, requires_grad=True); p.grad = torch.tensor([1.0, -1.0, 0.0])
>>> opt = Adam([p], AdamConfig(lr=0.1)); opt.step()
>>> [round(v, 4) for v in p.tolist()]
[0.9, 1.1, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hspmd.train.config import AdamConfig

__all__ = ["Adam"]


class Adam:
    """Adam over a list of leaf tensors; state is per tensor (``exp_avg``, ``exp_avg_sq``)."""

    def __init__(self, params: Sequence[torch.Tensor], config: AdamConfig) -> None:
        self.params = list(params)
        self.config = config
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        c = self.config
        self.steps += 1
        bias_correction1 = 1 - c.beta1**self.steps
        bias_correction2 = 1 - c.beta2**self.steps
        step_size = c.lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        for param, exp_avg, exp_avg_sq in zip(
            self.params, self.exp_avg, self.exp_avg_sq, strict=True
        ):
            grad = param.grad
            if grad is None:  # as torch does: no gradient, no update, no state change
                continue
            if c.weight_decay != 0:
                grad = grad.add(param, alpha=c.weight_decay)
            exp_avg.lerp_(grad, 1 - c.beta1)
            exp_avg_sq.mul_(c.beta2).addcmul_(grad, grad, value=1 - c.beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(c.eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None
