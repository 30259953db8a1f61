"""The global batch of each step: ``(tokens, targets)`` of shape (global_batch, seq_len).

Every rank and the reference draw the same stream of global batches from
``hspmd.data.batches`` (seeded; the stdlib sources by default, or ``--data``), then take
their rows; so data never depends on the plan. With gradient accumulation
(``grad_accum`` N) a step is N consecutive global batches stacked, N * global_batch rows:
pass k of the step takes rows [k * global_batch, (k + 1) * global_batch).

>>> from hspmd.train.config import TrainConfig
>>> config = TrainConfig(global_batch=2, seq_len=4, steps=2, data_max_bytes=1 << 16)
>>> [tokens.shape for tokens, _ in step_batches(config)]
[torch.Size([2, 4]), torch.Size([2, 4])]
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import torch

from hspmd.data import DEFAULT_MAX_BYTES, batches
from hspmd.train.config import TrainConfig

__all__ = ["accumulation_passes", "step_batches"]


def step_batches(config: TrainConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The ``config.steps`` steps' batches of a run, in order (``grad_accum`` global
    batches each, stacked)."""
    stream = batches(
        config.global_batch,
        config.seq_len,
        config.seed,
        path=config.data,
        max_bytes=config.data_max_bytes or DEFAULT_MAX_BYTES,
    )
    if config.grad_accum == 1:
        return islice(stream, config.steps)
    return (_stacked(list(islice(stream, config.grad_accum))) for _ in range(config.steps))


def _stacked(group: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([t for t, _ in group]), torch.cat([t for _, t in group])


def accumulation_passes(
    batch: tuple[torch.Tensor, torch.Tensor], config: TrainConfig
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step's batch cut into its ``grad_accum`` global batches (module docstring)."""
    size = config.global_batch
    return [(batch[0][k * size : (k + 1) * size], batch[1][k * size : (k + 1) * size])
            for k in range(config.grad_accum)]  # fmt: skip
