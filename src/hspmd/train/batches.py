"""The data of each step: fixed global batches ``(tokens, targets)`` of shape
(global_batch, seq_len), whole documents for variable-length steps, or the items of a
user's dataset (``--dataset``: ``hspmd.data.items``), one stacked tensor per field.

Every rank and the reference draw the same steps from the run's corpus
(``TrainConfig.data``: the stdlib sources by default, ``--data`` text, a token file, or
text with ``--tokenizer``), then take their rows; so data never depends on the plan. Step
``k``'s batch is a function of the seed, the data flags and ``k`` alone: token files compute
it directly (``hspmd.data.windows``), the byte corpus replays its stream from step 1. With gradient
accumulation (``grad_accum`` N) a step is N consecutive global batches stacked, N *
global_batch rows: pass k of the step takes rows [k * global_batch, (k + 1) * global_batch).
With ``--eval-split F`` the last fraction F of the corpus is held out (``hspmd.data.held_out``):
no step reads it, and ``eval_batches`` draws the evaluations' batches from it (or from
``--eval-data``).

>>> from hspmd.data.source import DataSpec
>>> from hspmd.train.config import BatchConfig, TrainConfig
>>> config = TrainConfig(batch=BatchConfig(global_batch=2, seq_len=4), steps=2,
...                      data=DataSpec(max_bytes=1 << 16))
>>> [tokens.shape for tokens, _ in step_batches(config)]
[torch.Size([2, 4]), torch.Size([2, 4])]
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np
import torch

from hspmd.data import DEFAULT_MAX_BYTES, DataError, DataSpec, DocumentStep, document_steps
from hspmd.data.corpus import byte_batches, load_documents
from hspmd.data.held_out import (
    byte_eval_batches,
    clip_documents,
    split_bytes,
    split_ids,
    token_eval_batches,
)
from hspmd.data.items import open_dataset
from hspmd.data.prepare import Progress
from hspmd.data.source import check_tokens, corpus_name, open_tokens, token_documents
from hspmd.data.steps import document_steps_of
from hspmd.data.windows import TokenWindows
from hspmd.train.config import TrainConfig

__all__ = ["accumulation_passes", "check_data", "eval_batches", "step_batches", "step_documents"]


def step_batches(config: TrainConfig, *, first: int = 1) -> Iterator[tuple[torch.Tensor, ...]]:
    """The batches of steps ``first`` .. ``config.steps``, in order (``grad_accum`` global
    batches each, stacked)."""
    n = config.batch.grad_accum
    if config.data.dataset is not None:
        return _item_batches(config, first)
    spec = config.data
    stream: Iterator[tuple[torch.Tensor, torch.Tensor]]
    if spec.tokenized:
        stream = _windows(config).stream((first - 1) * n + 1)
    else:
        texts = _byte_texts(config)
        stream = islice(
            byte_batches(texts, config.batch.global_batch, config.batch.seq_len, config.seed),
            (first - 1) * n,
            None,
        )
    count = max(config.steps - first + 1, 0)
    if n == 1:
        return islice(stream, count)
    return (_stacked(list(islice(stream, n))) for _ in range(count))


def _item_batches(config: TrainConfig, first: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Steps of a user's dataset (``hspmd.data.items``): global batch ``(k - 1) * n + j``
    for pass ``j`` of step ``k``, each field stacked, in the model's input order."""
    data = open_dataset(config.data.dataset or "")
    names = [f.name for f in data.layout.fields]
    order = [names.index(f.name) for f in config.model_config().batch]  # type: ignore[attr-defined]
    n, size = config.batch.grad_accum, config.batch.global_batch
    for step in range(first, config.steps + 1):
        parts = [data.batch((step - 1) * n + j, size=size, seed=config.seed) for j in range(n)]
        yield tuple(torch.cat([part[i] for part in parts]) for i in order)


def _windows(config: TrainConfig) -> TokenWindows:
    """The fixed windows of a token file's training part (``hspmd.data.held_out``)."""
    spec = config.data
    file = open_tokens(spec)
    ids, _ = split_ids(file.ids, config.evaluation.split)
    return TokenWindows(ids, config.batch.global_batch, config.batch.seq_len, config.seed,
                        where=_where(config, corpus_name(spec, file)))  # fmt: skip


def _byte_texts(config: TrainConfig) -> list[bytes]:
    """The byte corpus's documents the run trains on (its training part)."""
    docs = load_documents(config.data.path, max_bytes=config.data.max_bytes or DEFAULT_MAX_BYTES)
    return split_bytes(docs, config.evaluation.split)[0]


def _where(config: TrainConfig, name: str) -> str:
    split = config.evaluation.split
    return f"{name} (less the {split:g} held out)" if split else name


def eval_batches(config: TrainConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``config.evaluation.batches`` global batches every evaluation of the run reads:
    fixed windows of ``--eval-data`` or of the held-out part of ``--data``
    (``hspmd.data.held_out``); the same at every evaluation."""
    ev = config.evaluation
    spec = _eval_spec(config)
    size, seq_len = config.batch.global_batch, config.batch.seq_len
    if spec.tokenized:
        file = open_tokens(spec)
        ids = file.ids if ev.data is not None else split_ids(file.ids, ev.split)[1]
        where = _held_where(config, corpus_name(spec, file))
        return token_eval_batches(ids, count=ev.batches, global_batch=size, seq_len=seq_len,
                                  where=where)  # fmt: skip
    docs = load_documents(spec.path, max_bytes=spec.max_bytes or DEFAULT_MAX_BYTES)
    if ev.data is None:
        docs = split_bytes(docs, ev.split)[1]
    where = _held_where(config, spec.path or "the standard library sources")
    return byte_eval_batches(docs, count=ev.batches, global_batch=size, seq_len=seq_len,
                             where=where)  # fmt: skip


def _eval_spec(config: TrainConfig) -> DataSpec:
    """The corpus evaluations read: ``--eval-data`` with the run's data flags, else the
    run's own (its held-out part)."""
    spec = config.data
    data = config.evaluation.data
    if data is None:
        return spec
    out = DataSpec(path=data, dtype=spec.dtype, eod_id=spec.eod_id, tokenizer=spec.tokenizer,
                   cache=spec.cache, max_bytes=spec.max_bytes)  # fmt: skip
    if out.tokenized != spec.tokenized:
        what = {"bytes": "text (the byte corpus)", "tokens": "a token file",
                "text": "text with --tokenizer"}  # fmt: skip
        raise DataError(
            f"--eval-data {data} is {what[out.kind]} but --data is {what[spec.kind]}: "
            "evaluate on data of the same vocabulary (a token file of the same tokenizer, "
            "or text with the same --tokenizer)"
        )
    return out


def _held_where(config: TrainConfig, name: str) -> str:
    split = config.evaluation.split
    return name if config.evaluation.data is not None else f"the held-out {split:g} of {name}"


def _stacked(group: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([t for t, _ in group]), torch.cat([t for _, t in group])


def accumulation_passes(
    batch: tuple[torch.Tensor, ...], config: TrainConfig
) -> list[tuple[torch.Tensor, ...]]:
    """A step's batch (tokens and targets, or a dataset's fields) cut into its
    ``grad_accum`` global batches (module docstring)."""
    size = config.batch.global_batch
    return [
        tuple(t[k * size : (k + 1) * size] for t in batch) for k in range(config.batch.grad_accum)
    ]


def step_documents(config: TrainConfig, *, min_documents: int) -> Iterator[DocumentStep]:
    """Endless variable-length steps of whole documents (``config.batch.step_tokens`` tokens at
    most, ``config.batch.seq_len`` a document) from the run's corpus."""
    spec, batch = config.data, config.batch
    assert batch.step_tokens is not None
    if spec.tokenized:
        file = open_tokens(spec)
        trained, _ = split_ids(file.ids, config.evaluation.split)  # documents end there
        return document_steps_of(
            clip_documents(token_documents(spec, file), len(trained)), batch.step_tokens,
            config.seed, max_len=batch.seq_len, long_docs=batch.long_docs,
            min_documents=min_documents,
        )  # fmt: skip
    return document_steps(
        batch.step_tokens, config.seed, max_len=batch.seq_len, long_docs=batch.long_docs,
        min_documents=min_documents, texts=_byte_texts(config),
    )  # fmt: skip


def check_data(config: TrainConfig, *, on_progress: Progress | None = None) -> None:
    """One-line errors before any process starts: the corpus is readable and not empty,
    holds one step, its ids are below the model's vocabulary (a tokenizer's vocabulary too);
    text with a tokenizer is tokenized into the cache here (``on_progress``: its bytes).
    With evaluations, the same of their data, which must hold ``--eval-batches`` batches."""
    if config.data.dataset is not None:  # one step's items, collated (hspmd.data.items)
        rows = config.batch.global_batch * config.batch.grad_accum
        open_dataset(config.data.dataset).check_step(rows, seed=config.seed)
        return
    spec = config.data
    vocab = config.model_config().vocab_size
    if spec.tokenized:
        check_tokens(spec, vocab_size=vocab, on_progress=on_progress)
        if not config.batch.packed:
            _windows(config)  # raises: fewer tokens than one step
    elif not config.batch.packed:  # packed: the caller draws the first step (trainer.check_config)
        _check_bytes(config.data.path, vocab=vocab, max_bytes=config.data.max_bytes)
        # raises before the first batch: an empty corpus, fewer bytes than one step
        byte_batches(
            _byte_texts(config), config.batch.global_batch, config.batch.seq_len, config.seed
        )
    if not config.evaluation.every:
        return
    held = _eval_spec(config)
    if config.evaluation.data is not None:
        if held.tokenized:
            check_tokens(held, vocab_size=vocab, on_progress=on_progress)
        else:
            _check_bytes(held.path, vocab=vocab, max_bytes=held.max_bytes)
    eval_batches(config)  # raises: fewer windows than one evaluation reads


def _check_bytes(path: str | None, *, vocab: int, max_bytes: int | None) -> None:
    """The byte corpus at ``path`` fits the model's vocabulary (bytes are ids 0..255)."""
    if vocab >= 256:
        return
    docs = load_documents(path, max_bytes=max_bytes or DEFAULT_MAX_BYTES)
    largest = int(np.frombuffer(b"".join(docs), dtype=np.uint8).max())
    if largest >= vocab:
        raise DataError(
            f"{path or 'the byte corpus'} is read as raw bytes (no --tokenizer) and holds byte "
            f"{largest}, not below the model's vocabulary of {vocab}: give --tokenizer "
            "(yours, to tokenize the text) or a token file, or a model with a vocabulary of "
            """256 (--config '{"vocab_size": 256}'; docs/data.md)"""
        )
