"""A per-tensor AdamW whose numbers equal ``torch.optim.AdamW`` elementwise.

AdamW is elementwise, so running it on any slice of a parameter (with the matching slice
of the gradient) gives exactly that slice of the full update: each rank steps only its
local pieces and the result equals single-device training. The arithmetic mirrors
torch's single-tensor implementation operation by operation, so results are bitwise
equal to ``torch.optim.AdamW(foreach=False)`` with the same parameter groups (``decays``)
and the learning rate of ``hspmd.train.lr.learning_rate`` set before each step. Weight
decay is decoupled: ``p *= 1 - lr * weight_decay``, then the Adam update; with
``weight_decay=0`` (the default) this is plain Adam.

>>> import torch
>>> p = torch.ones(3, requires_grad=True); p.grad = torch.tensor([1.0, -1.0, 0.0])
>>> opt = Adam([p], AdamConfig(lr=0.1)); opt.step()
>>> [round(v, 4) for v in p.tolist()]
[0.9, 1.1, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch

from hspmd.train.config import AdamConfig
from hspmd.train.lr import learning_rate

__all__ = ["Adam", "decays"]


def decays(name: str, ndim: int, no_decay: tuple[str, ...] | None) -> bool:
    """Whether parameter ``name`` (of ``ndim`` dims) takes weight decay: not if it matches
    a pattern of ``no_decay``; with ``no_decay=None`` the default rule, decay for matrices
    and embeddings (ndim >= 2), none for biases and norm weights (ndim < 2).

    >>> decays("layers.0.attn.wq.weight", 2, None), decays("norm.weight", 1, None)
    (True, False)
    >>> decays("embed.weight", 2, ("embed.*", "*.bias")), decays("norm.weight", 1, ())
    (False, True)
    """
    if no_decay is None:
        return ndim >= 2
    return not any(fnmatchcase(name, pattern) for pattern in no_decay)


class Adam:
    """AdamW over a list of leaf tensors; state is per tensor (``exp_avg``, ``exp_avg_sq``).

    ``names``: the parameter each tensor is a piece of (for ``decays``; None: every tensor
    decays). The learning rate of each step comes from ``config``'s schedule at the step
    count (``steps``, restored by a resume or a switch), so ``config.decay_steps`` must be
    resolved for decaying schedules (``TrainConfig.optimizer``).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], config: AdamConfig, *,
        names: Sequence[str] | None = None,
    ) -> None:  # fmt: skip
        self.params = list(params)
        self.config = config
        if names is None:
            self.decay = [True] * len(self.params)
        else:
            self.decay = [
                decays(n, p.ndim, config.no_decay) for n, p in zip(names, self.params, strict=True)
            ]
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        c = self.config
        self.steps += 1
        lr = learning_rate(c, self.steps)
        bias_correction1 = 1 - c.beta1**self.steps
        bias_correction2 = 1 - c.beta2**self.steps
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        for param, exp_avg, exp_avg_sq, decay in zip(
            self.params, self.exp_avg, self.exp_avg_sq, self.decay, strict=True
        ):
            grad = param.grad
            if grad is None:  # as torch does: no gradient, no update, no state change
                continue
            if decay and c.weight_decay != 0:
                param.mul_(1 - lr * c.weight_decay)
            exp_avg.lerp_(grad, 1 - c.beta1)
            exp_avg_sq.mul_(c.beta2).addcmul_(grad, grad, value=1 - c.beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(c.eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None
