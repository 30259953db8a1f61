"""Byte-level training data from real text, available offline.

By default the corpus is the Python standard library's own source (the ``*.py`` files at
the top of ``sysconfig.get_paths()["stdlib"]``, sorted by name): real text of very mixed
length, on every machine that runs this package. ``path`` reads a user's file instead: a
JSONL file (``.jsonl``: one object with a ``"text"`` field per line, one document each), any
other file (one document), or a directory (its files, sorted, recursively).

Tokens are the UTF-8 bytes (vocabulary 256). ``batches`` shuffles the documents with the
seed, joins them with a 0 byte between documents, and cuts the stream into windows of
``seq_len + 1`` bytes: ``tokens = window[:-1]``, ``targets = window[1:]``. After an epoch
it reshuffles (seed + epoch) and goes on forever. Same seed, same batches::

    >>> stream = batches(4, 16, seed=0)
    >>> tokens, targets = next(stream)
    >>> tokens.shape, tokens.dtype, bool((tokens[:, 1:] == targets[:, :-1]).all())
    (torch.Size([4, 16]), torch.int64, True)

``documents`` yields whole documents of varying length (for mixed-length planning).
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from hspmd.errors import HspmdError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DataError",
    "batches",
    "data_warnings",
    "documents",
    "load_documents",
]

DEFAULT_MAX_BYTES = 8 << 20
"""Reading stops after this many bytes of text (the default corpus is about 3-6 MB)."""

SEPARATOR = 0
"""The byte between documents."""


class DataError(HspmdError, ValueError):
    """A data file that is missing, empty, unreadable, or too short for the request."""


def load_documents(path: str | Path | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[bytes]:  # fmt: skip
    """Documents as UTF-8 bytes, in a fixed order (module docstring).

    >>> docs = load_documents()
    >>> len(docs) > 100, min(map(len, docs)) < 2000 < max(map(len, docs))
    (True, True)
    """
    if path is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(stdlib.glob("*.py"))
        if not files:
            raise DataError(f"no *.py files in the standard library at {stdlib}: give a path")
    else:
        root = Path(path)
        if not root.exists():
            raise DataError(
                f"data path {str(root)!r} does not exist: give a text file, a JSONL file "
                '(one {"text": ...} per line) or a directory of text files'
            )
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    docs: list[bytes] = []
    total = 0
    for file in files:
        for doc in _read_file(file):
            if doc:
                docs.append(doc)
                total += len(doc)
        if total >= max_bytes:
            break
    if not docs:
        raise DataError(f"no text in {path or 'the standard library'}: the data is empty")
    return docs


def _read_file(file: Path) -> list[bytes]:
    try:
        raw = file.read_bytes()
    except OSError as error:
        raise DataError(f"cannot read data file {str(file)!r}: {error}") from None
    if file.suffix != ".jsonl":
        return [raw]
    docs = []
    for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text = record["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(
                f'{file}:{number}: expected a JSON object with a "text" field, got {line[:60]!r}'
            ) from None
        if not isinstance(text, str):
            raise DataError(f'{file}:{number}: "text" must be a string, not {type(text).__name__}')
        docs.append(text.encode("utf-8"))
    return docs


def _shuffled_stream(docs: list[bytes], seed: int) -> np.ndarray:
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    joined = bytes([SEPARATOR]).join(docs[i] for i in order) + bytes([SEPARATOR])
    return np.frombuffer(joined, dtype=np.uint8)


def batches(
    global_batch: int,
    seq_len: int,
    seed: int = 0,
    *,
    path: str | Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(tokens, targets)``, both ``(global_batch, seq_len)`` int64 (module docstring)."""
    if global_batch < 1 or seq_len < 1:
        raise DataError(f"{global_batch=} and {seq_len=} must both be at least 1")
    docs = load_documents(path, max_bytes=max_bytes)
    window = seq_len + 1
    need = global_batch * window
    total = sum(map(len, docs)) + len(docs)
    if total < need:
        raise DataError(
            f"the data holds {total} bytes, fewer than one batch needs "
            f"({global_batch} x {window}): use more text or a smaller batch or seq_len"
        )
    return _batches(docs, global_batch, window, seed)


def _batches(
    docs: list[bytes], global_batch: int, window: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    epoch = 0
    while True:
        stream = _shuffled_stream(docs, seed + epoch)
        count = len(stream) // (window * global_batch)
        rows = stream[: count * global_batch * window].reshape(count, global_batch, window)
        for batch in rows:
            tensor = torch.from_numpy(batch.astype(np.int64))
            yield tensor[:, :-1], tensor[:, 1:]
        epoch += 1


def documents(
    seed: int = 0,
    *,
    path: str | Path | None = None,
    max_len: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Iterator[torch.Tensor]:
    """Each document once, in seeded order, as a 1-D int64 tensor (cut to ``max_len``).

    >>> lengths = [len(d) for d, _ in zip(documents(0, max_len=4096), range(50), strict=False)]
    >>> min(lengths) < 4096 == max(lengths)
    True
    """
    docs = load_documents(path, max_bytes=max_bytes)
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    for i in order:
        doc = docs[i] if max_len is None else docs[i][:max_len]
        yield torch.from_numpy(np.frombuffer(doc, dtype=np.uint8).astype(np.int64))


def data_warnings(
    path: str | Path | None,
    *,
    global_batch: int,
    seq_len: int,
    steps: int,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[str]:
    """What a user should hear before training on ``path`` (the run still goes ahead): a
    JSONL file named ``.json`` (read as one raw document), a corpus that ``steps`` reuse.

    >>> data_warnings(None, global_batch=1, seq_len=16, steps=1)
    []
    """
    out = []
    file = None if path is None else Path(path)
    if file is not None and file.is_file() and file.suffix == ".json" and _looks_like_jsonl(file):
        out.append(
            f'{path} holds one {{"text": ...}} object per line but is named .json, so it '
            "trains on the raw JSON text as one document: rename it to .jsonl"
        )
    docs = load_documents(path, max_bytes=max_bytes)
    total = sum(map(len, docs)) + len(docs)
    need = steps * global_batch * (seq_len + 1)
    if need > total:
        out.append(
            f"the data holds {total:,} bytes and {steps} steps of {global_batch} x "
            f"{seq_len + 1} need {need:,}: it is reused {need / total:.1f} times (reshuffled "
            "each pass); give more text (--data, --data-max-bytes) to see each byte once"
        )
    return out


def _looks_like_jsonl(file: Path) -> bool:
    try:
        with file.open(encoding="utf-8", errors="replace") as handle:
            lines = [line for line in (handle.readline() for _ in range(3)) if line.strip()]
        return bool(lines) and all(
            isinstance(record := json.loads(line), dict) and "text" in record for line in lines
        )
    except (OSError, json.JSONDecodeError):
        return False
