"""Steps of whole documents for variable-length training, from any corpus.

A corpus is ``Documents``: each document's length in tokens, its ids on demand, and its
order in each epoch. ``document_steps_of`` walks the documents in that order and groups
them into steps of at most ``tokens_per_step`` tokens (docs/mixed-length.md). A document of
``n`` tokens is ``n + 1`` ids: ``n`` tokens predicting the next id (the last id, the end of
the document, is only a target). Documents over ``max_len`` tokens are truncated, dropped or
refused (``long_docs``), and counted in their step.

The steps are a function of the seed and the corpus only: every rank and the reference walk
the same order, so step ``k`` holds the same documents whatever the strategy.

>>> from itertools import islice
>>> docs = ListDocuments([torch.arange(n + 1) for n in (3, 9, 2, 4)])
>>> [s.lengths for s in islice(document_steps_of(docs, 8, seed=0, max_len=8), 3)]
[(2, 3), (8,), (4, 4)]
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hspmd.data.errors import DataError

__all__ = ["LONG_DOCS", "DocumentStep", "Documents", "ListDocuments", "document_steps_of"]

LONG_DOCS = ("truncate", "drop", "error")
"""What a document longer than ``max_len`` tokens becomes."""


@dataclass(frozen=True, slots=True)
class DocumentStep:
    """One step's documents (1-D int64 ids: the tokens, then the end of the document) and
    what was cut."""

    documents: tuple[torch.Tensor, ...]
    truncated: int = 0  # documents of this step cut to max_len
    dropped: int = 0  # documents left out before this step for being too long

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens of each document (its ids minus one)."""
        return tuple(len(d) - 1 for d in self.documents)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


class Documents(Protocol):
    """A corpus as ``document_steps_of`` reads it."""

    @property
    def where(self) -> str:
        """The corpus, for errors (a path)."""
        ...

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each document (its ids minus one), int64."""
        ...

    def ids(self, index: int, max_len: int | None) -> torch.Tensor:
        """Document ``index``'s ids (1-D int64), cut to ``max_len`` tokens when given."""
        ...

    def order(self, seed: int, epoch: int) -> Iterable[int]:
        """Every document's index once, in the order of ``epoch``."""
        ...


@dataclass(frozen=True, slots=True, eq=False)
class ListDocuments:
    """Documents held in memory as id tensors (tests, small corpora); seeded shuffles."""

    docs: list[torch.Tensor]
    where: str = "the documents"

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(d) - 1 for d in self.docs], dtype=np.int64)

    def ids(self, index: int, max_len: int | None) -> torch.Tensor:
        doc = self.docs[index]
        return doc if max_len is None else doc[: max_len + 1]

    def order(self, seed: int, epoch: int) -> Iterable[int]:
        order = list(range(len(self.docs)))
        random.Random(seed + epoch).shuffle(order)
        return order


def document_steps_of(
    docs: Documents,
    tokens_per_step: int,
    seed: int = 0,
    *,
    max_len: int,
    long_docs: str = "truncate",
    min_documents: int = 1,
) -> Iterator[DocumentStep]:
    """Endless steps of whole documents, at most ``tokens_per_step`` tokens each (module
    docstring); a step holds at least ``min_documents`` documents (it goes over the token
    count if it must). Reshuffled each epoch; same seed, same steps. Checked here, before
    the first step: the options, documents too long under ``long_docs="error"``, fewer
    usable documents than a step needs."""
    if long_docs not in LONG_DOCS:
        raise DataError(f"long_docs={long_docs!r}: choose one of {', '.join(LONG_DOCS)}")
    if tokens_per_step < 1 or max_len < 1 or min_documents < 1:
        raise DataError(
            f"{tokens_per_step=}, {max_len=} and {min_documents=} must all be at least 1"
        )
    if max_len > tokens_per_step:
        raise DataError(
            f"max_len={max_len} is more than tokens_per_step={tokens_per_step}: a step could "
            "not hold a document of the maximum length; raise the tokens per step"
        )
    lengths = docs.lengths
    long = np.flatnonzero(lengths > max_len)
    if len(long) and long_docs == "error":
        first = int(long[0])
        raise DataError(
            f"document {first} of {docs.where} has {int(lengths[first])} tokens, more than the "
            f"maximum sequence length {max_len} ({len(long)} such documents): use --long-docs "
            "truncate or drop, or a larger --max-seq-len"
        )
    kept = len(lengths) - (len(long) if long_docs == "drop" else 0)
    if kept < min_documents:
        raise DataError(
            f"{docs.where} has {kept} usable document{'s' * (kept != 1)}, fewer than the "
            f"{min_documents} one step needs (one per micro-batch): use more documents (a "
            "JSONL line is one, so is a text file with --tokenizer; docs/data.md) or fewer "
            "micro-batches"
        )
    return _steps(docs, tokens_per_step, seed, max_len, long_docs, min_documents)


def _document_stream(
    docs: Documents, seed: int, max_len: int, long_docs: str
) -> Iterator[tuple[int | None, bool]]:
    """``(index, truncated)`` forever; ``(None, False)`` for a dropped document."""
    lengths = docs.lengths
    epoch = 0
    while True:
        for i in docs.order(seed, epoch):
            if lengths[i] <= max_len:
                yield int(i), False
            elif long_docs == "drop":
                yield None, False
            else:
                yield int(i), True
        epoch += 1


def _steps(
    docs: Documents, tokens_per_step: int, seed: int, max_len: int, long_docs: str,
    min_documents: int,
) -> Iterator[DocumentStep]:  # fmt: skip
    lengths = docs.lengths
    stream = _document_stream(docs, seed, max_len, long_docs)
    pending = next(stream)
    while True:
        chosen: list[torch.Tensor] = []
        total = truncated = dropped = 0
        while True:
            index, cut = pending
            if index is None:
                dropped += 1
            else:
                size = max_len if cut else int(lengths[index])
                if total + size > tokens_per_step and len(chosen) >= min_documents:
                    break  # the next step starts with it
                chosen.append(docs.ids(index, max_len if cut else None))
                total += size
                truncated += cut
            pending = next(stream)
        yield DocumentStep(tuple(chosen), truncated=truncated, dropped=dropped)
