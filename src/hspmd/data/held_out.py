"""The held-out part of a corpus: its last fraction, never trained on, and the evaluation
batches drawn from it.

``--eval-split F`` cuts the corpus at one position, a pure function of the data flags:
of ``total`` ids (a token file) or bytes (the byte corpus, its documents in file order),
the first ``total - ceil(F x total)`` are the training part, the rest the held-out part::

    ids        0 1 2 3 4 5 6 7 8 9      --eval-split 0.2: the cut at 8
    training   t t t t t t t t          windows and documents end before the cut
    held out                   h h      evaluation windows start at it

Training windows lie inside the training part (their last target is id ``cut - 1`` at
most); a token file's document that straddles the cut keeps its part before it, a byte
document is cut in two. Evaluation reads fixed batches: ``count`` global batches of
``seq_len`` tokens from the held-out part (or from ``--eval-data``, whole), the first
``count x global_batch`` windows of the order seed 0 gives (``hspmd.data.windows``;
independent of ``--seed``, so that runs of any seed are scored on the same windows).

>>> ids = np.arange(100, dtype=np.uint16)
>>> train, held = split_ids(ids, 0.2)
>>> len(train), int(held[0])
(80, 80)
>>> [len(d) for part in split_bytes([b"abcdef", b"ghij"], 0.3) for d in part]
[6, 1, 3]
"""

from __future__ import annotations

import math
from itertools import islice

import numpy as np
import torch

from hspmd.data.corpus import byte_batches
from hspmd.data.errors import DataError
from hspmd.data.tokens import TokenDocuments
from hspmd.data.windows import TokenWindows

__all__ = ["byte_eval_batches", "clip_documents", "cut", "split_bytes", "split_ids",
           "token_eval_batches"]  # fmt: skip

Batch = tuple[torch.Tensor, torch.Tensor]
EVAL_SEED = 0
"""The seed of the evaluation windows' order (not the run's: every run sees the same)."""


def cut(total: int, fraction: float) -> int:
    """Where the held-out part of ``total`` ids or bytes starts (``total`` with 0).

    >>> cut(1000, 0.01), cut(7, 0.5), cut(7, 0.0)
    (990, 3, 7)
    """
    return total - math.ceil(total * fraction)


def split_ids(ids: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """A token file's ids as (training part, held-out part): memory-mapped views."""
    at = cut(len(ids), fraction)
    return ids[:at], ids[at:]


def split_bytes(docs: list[bytes], fraction: float) -> tuple[list[bytes], list[bytes]]:
    """The byte corpus's documents (in file order) as (training part, held-out part); the
    document across the cut is cut in two."""
    at = cut(sum(map(len, docs)), fraction)
    train: list[bytes] = []
    held: list[bytes] = []
    seen = 0
    for doc in docs:
        head = max(0, min(len(doc), at - seen))
        if head:
            train.append(doc[:head])
        if head < len(doc):
            held.append(doc[head:])
        seen += len(doc)
    return train, held


def clip_documents(docs: TokenDocuments, end: int) -> TokenDocuments:
    """The documents of a token file that hold ids before ``end``, cut there (a document
    keeps at least two ids: one token and its target)."""
    starts, ends = docs.starts, np.minimum(docs.ends, end)
    keep = ends - starts >= 2
    return TokenDocuments(docs.tokens, starts[keep], ends[keep], where=docs.where)


def _enough(windows: int, *, count: int, global_batch: int, seq_len: int, where: str) -> None:
    if windows < count * global_batch:
        raise DataError(
            f"{where} holds {windows:,} windows of {seq_len + 1} ids, fewer than --eval-batches "
            f"{count} x --global-batch {global_batch} = {count * global_batch:,} need: hold out "
            "more (--eval-split, --eval-data) or lower --eval-batches"
        )


def token_eval_batches(
    ids: np.ndarray, *, count: int, global_batch: int, seq_len: int, where: str
) -> list[Batch]:
    """``count`` evaluation batches of ``ids`` (the module docstring's windows)."""
    windows = max(len(ids) - 1, 0) // seq_len
    _enough(windows, count=count, global_batch=global_batch, seq_len=seq_len, where=where)
    source = TokenWindows(ids, global_batch, seq_len, EVAL_SEED, where=where)
    return [source.batch(k) for k in range(1, count + 1)]


def byte_eval_batches(
    docs: list[bytes], *, count: int, global_batch: int, seq_len: int, where: str
) -> list[Batch]:
    """``count`` evaluation batches of byte documents (their first pass, seed 0)."""
    total = sum(map(len, docs)) + len(docs)  # the documents and a separator after each
    _enough(total // (seq_len + 1), count=count, global_batch=global_batch, seq_len=seq_len,
            where=where)  # fmt: skip
    return list(islice(byte_batches(docs, global_batch, seq_len, EVAL_SEED), count))
