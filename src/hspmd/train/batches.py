"""The data of each step: fixed global batches ``(tokens, targets)`` of shape
(global_batch, seq_len), or whole documents for variable-length steps.

Every rank and the reference draw the same steps from the run's corpus
(``TrainConfig.data_spec``: the stdlib sources by default, ``--data`` text, a token file, or
text with ``--tokenizer``), then take their rows; so data never depends on the plan. Step
``k``'s batch is a function of the seed, the data flags and ``k`` alone: token files compute
it directly (``hspmd.data.windows``), the byte corpus replays its stream from step 1. With gradient
accumulation (``grad_accum`` N) a step is N consecutive global batches stacked, N *
global_batch rows: pass k of the step takes rows [k * global_batch, (k + 1) * global_batch).

>>> from hspmd.train.config import TrainConfig
>>> config = TrainConfig(global_batch=2, seq_len=4, steps=2, data_max_bytes=1 << 16)
>>> [tokens.shape for tokens, _ in step_batches(config)]
[torch.Size([2, 4]), torch.Size([2, 4])]
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np
import torch

from hspmd.data import DEFAULT_MAX_BYTES, DataError, DocumentStep, batches, document_steps
from hspmd.data.corpus import load_documents
from hspmd.data.prepare import Progress
from hspmd.data.source import check_tokens, open_tokens, token_documents
from hspmd.data.steps import document_steps_of
from hspmd.data.windows import TokenWindows
from hspmd.train.config import TrainConfig

__all__ = ["accumulation_passes", "check_data", "step_batches", "step_documents"]


def step_batches(
    config: TrainConfig, *, first: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of steps ``first`` .. ``config.steps``, in order (``grad_accum`` global
    batches each, stacked)."""
    n = config.grad_accum
    spec = config.data_spec
    stream: Iterator[tuple[torch.Tensor, torch.Tensor]]
    if spec.tokenized:
        file = open_tokens(spec)
        windows = TokenWindows(file.ids, config.global_batch, config.seq_len, config.seed,
                               where=str(spec.path or file.path))  # fmt: skip
        stream = windows.stream((first - 1) * n + 1)
    else:
        stream = islice(
            batches(
                config.global_batch,
                config.seq_len,
                config.seed,
                path=config.data,
                max_bytes=config.data_max_bytes or DEFAULT_MAX_BYTES,
            ),
            (first - 1) * n,
            None,
        )
    count = max(config.steps - first + 1, 0)
    if n == 1:
        return islice(stream, count)
    return (_stacked(list(islice(stream, n))) for _ in range(count))


def _stacked(group: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([t for t, _ in group]), torch.cat([t for _, t in group])


def accumulation_passes(
    batch: tuple[torch.Tensor, torch.Tensor], config: TrainConfig
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step's batch cut into its ``grad_accum`` global batches (module docstring)."""
    size = config.global_batch
    return [(batch[0][k * size : (k + 1) * size], batch[1][k * size : (k + 1) * size])
            for k in range(config.grad_accum)]  # fmt: skip


def step_documents(config: TrainConfig, *, min_documents: int) -> Iterator[DocumentStep]:
    """Endless variable-length steps of whole documents (``config.step_tokens`` tokens at
    most, ``config.seq_len`` a document) from the run's corpus."""
    assert config.step_tokens is not None
    spec = config.data_spec
    if spec.tokenized:
        return document_steps_of(
            token_documents(spec, open_tokens(spec)), config.step_tokens, config.seed,
            max_len=config.seq_len, long_docs=config.long_docs, min_documents=min_documents,
        )  # fmt: skip
    return document_steps(
        config.step_tokens, config.seed, max_len=config.seq_len, long_docs=config.long_docs,
        min_documents=min_documents, path=config.data,
        max_bytes=config.data_max_bytes or DEFAULT_MAX_BYTES,
    )  # fmt: skip


def check_data(config: TrainConfig, *, on_progress: Progress | None = None) -> None:
    """One-line errors before any process starts: the corpus is readable and not empty,
    holds one step, its ids are below the model's vocabulary (a tokenizer's vocabulary too);
    text with a tokenizer is tokenized into the cache here (``on_progress``: its bytes)."""
    spec = config.data_spec
    vocab = config.model_config().vocab_size
    if not spec.tokenized:
        if config.packed:
            return  # the caller draws the first packed step (hspmd.train.trainer.check_config)
        max_bytes = config.data_max_bytes or DEFAULT_MAX_BYTES
        if vocab < 256:
            docs = load_documents(config.data, max_bytes=max_bytes)
            largest = int(np.frombuffer(b"".join(docs), dtype=np.uint8).max())
            if largest >= vocab:
                raise DataError(
                    f"the byte corpus holds byte {largest}, not below the model's vocabulary "
                    f"of {vocab}: the byte corpus needs a vocabulary of 256 (--config "
                    """'{"vocab_size": 256}'), or give a token file (docs/data.md)"""
                )
        # raises before the first batch: an empty corpus, fewer bytes than one step
        batches(config.global_batch, config.seq_len, config.seed, path=config.data,
                max_bytes=max_bytes)  # fmt: skip
        return
    file = check_tokens(spec, vocab_size=vocab, on_progress=on_progress)
    if not config.packed:
        TokenWindows(file.ids, config.global_batch, config.seq_len, config.seed,
                     where=str(spec.path or file.path))  # fmt: skip
