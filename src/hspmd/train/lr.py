"""Learning-rate schedules: the learning rate of an optimizer step, a pure function of it.

Step ``s`` is 1-based (the s-th optimizer step); ``t = s - 1`` steps came before it. With
peak ``lr``, warm-up ``W``, decay horizon ``D`` (``decay_steps``) and ``min_lr``::

    t < W          lr * (t + 1) / W                       linear warm-up; step W has lr
    W <= t < D     min_lr + (lr - min_lr) * f(p),  p = (t - W) / (D - W)
                   cosine: f(p) = (1 + cos(pi p)) / 2     linear: f(p) = 1 - p
    t >= D         min_lr                                 (constant: lr for every t >= W)

    lr ┤     ___
       │    /   ‾‾-_                   cosine
       │   /        ‾-_
       │  /            ‾-__
  min  ┤ /                 ‾‾‾‾‾‾‾
       └─┴──┴───────────────┴──────── step
           W                D

This is torch's ``LinearLR`` warm-up followed by ``CosineAnnealingLR`` (``T_max = D - W``)
or ``LinearLR`` decay, stepped once per optimizer step (tests/train/test_recipe.py checks
it against them). Nothing but the step decides it, so a switch, an elastic recovery and a
resume give the learning rate of the uninterrupted run; the checkpoint's Adam step is the
schedule's position.

>>> from hspmd.train.config import AdamConfig
>>> c = AdamConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, decay_steps=4, min_lr=0.1)
>>> [round(learning_rate(c, s), 4) for s in range(1, 7)]
[0.5, 1.0, 1.0, 0.55, 0.1, 0.1]
"""

from __future__ import annotations

import math

from hspmd.train.config import AdamConfig, TrainError

__all__ = ["learning_rate"]


def learning_rate(config: AdamConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based) under ``config``'s schedule
    (``decay_steps`` resolved: ``TrainConfig.optimizer``)."""
    if step < 1:
        raise TrainError(f"step {step}: optimizer steps count from 1")
    t, warmup = step - 1, config.warmup_steps
    if t < warmup:
        return config.lr * (t + 1) / warmup
    if not config.decaying:
        return config.lr
    horizon = config.decay_steps
    if horizon is None:
        raise TrainError(
            f"the {config.lr_schedule} schedule needs decay_steps: give --decay-steps, or take "
            "the config's resolved optimizer (TrainConfig.optimizer: --steps)"
        )
    if t >= horizon:
        return config.min_lr
    progress = (t - warmup) / (horizon - warmup)
    if config.lr_schedule == "cosine":
        factor = (1 + math.cos(math.pi * progress)) / 2
    else:
        factor = 1 - progress
    return config.min_lr + (config.lr - config.min_lr) * factor
