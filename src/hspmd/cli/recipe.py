"""The optimizer recipe's flags read into an ``AdamConfig``, the evaluation's into an
``EvalConfig`` (``hspmd train``, ``hspmd demo``).

>>> import argparse
>>> args = argparse.Namespace(lr=3e-4, betas="0.9,0.95", weight_decay=0.1, no_decay="*.bias, norm.*")
>>> config = adam_from_args(args)
>>> (config.beta2, config.no_decay, config.lr_schedule)
(0.95, ('*.bias', 'norm.*'), 'constant')
"""

from __future__ import annotations

import argparse

from hspmd.train.config import AdamConfig, EvalConfig, TrainError

__all__ = ["adam_from_args", "eval_from_args", "parse_betas", "parse_no_decay"]

_DEFAULT = AdamConfig()


def parse_betas(text: str | None) -> tuple[float, float]:
    """``"0.9,0.95"`` -> ``(0.9, 0.95)`` (None: the defaults)."""
    if text is None:
        return _DEFAULT.beta1, _DEFAULT.beta2
    parts = text.split(",")
    try:
        beta1, beta2 = (float(p) for p in parts)
    except ValueError:
        raise TrainError(f"--betas {text!r}: write BETA1,BETA2, e.g. 0.9,0.95") from None
    return beta1, beta2


def parse_no_decay(text: str | None) -> tuple[str, ...] | None:
    """``"*.bias,*norm*"`` -> name patterns; ``""`` -> none (every parameter decays);
    None -> None (the default rule: parameters of fewer than two dims are exempt)."""
    if text is None:
        return None
    return tuple(p.strip() for p in text.split(",") if p.strip())


def adam_from_args(args: argparse.Namespace) -> AdamConfig:
    """The ``AdamConfig`` of the recipe flags (those a command lacks keep their defaults)."""
    beta1, beta2 = parse_betas(getattr(args, "betas", None))
    return AdamConfig(
        lr=args.lr,
        beta1=beta1,
        beta2=beta2,
        eps=getattr(args, "eps", _DEFAULT.eps),
        weight_decay=getattr(args, "weight_decay", _DEFAULT.weight_decay),
        no_decay=parse_no_decay(getattr(args, "no_decay", None)),
        lr_schedule=getattr(args, "lr_schedule", _DEFAULT.lr_schedule),
        warmup_steps=getattr(args, "warmup_steps", _DEFAULT.warmup_steps),
        decay_steps=getattr(args, "decay_steps", None),
        min_lr=getattr(args, "min_lr", _DEFAULT.min_lr),
        clip_grad_norm=getattr(args, "clip_grad_norm", None),
    )


def eval_from_args(args: argparse.Namespace) -> EvalConfig:
    """The ``EvalConfig`` of ``--eval-every``, ``--eval-batches``, ``--eval-data``,
    ``--eval-split`` (those a command lacks keep their defaults)."""
    default = EvalConfig()
    return EvalConfig(
        every=getattr(args, "eval_every", default.every),
        batches=getattr(args, "eval_batches", default.batches),
        data=getattr(args, "eval_data", default.data),
        split=getattr(args, "eval_split", default.split),
    )
