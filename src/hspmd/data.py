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

``document_steps`` is the data of variable-length training (docs/mixed-length.md): the
text split into documents (``split_documents``: a JSONL record is one; a text file splits
at blank lines before an unindented line, so Python sources give one document per
top-level block: long-tailed lengths), in seeded order, grouped into steps of at most
``tokens_per_step`` tokens. A document of ``n`` bytes is ``n + 1`` ids (its bytes, then the
0 byte): ``n`` tokens predicting the next byte. Documents over ``max_len`` tokens are
truncated, dropped or refused (``long_docs``), and counted in their step::

    >>> step = next(document_steps(2048, max_len=256, max_bytes=1 << 18))
    >>> sum(step.lengths) <= 2048, max(step.lengths) <= 256, len(step.documents) > 1
    (True, True, True)
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hspmd.errors import HspmdError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "LONG_DOCS",
    "DataError",
    "DocumentStep",
    "batches",
    "data_warnings",
    "document_steps",
    "documents",
    "load_documents",
    "split_documents",
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
            yield tensor[:, :-1].contiguous(), tensor[:, 1:].contiguous()
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
    step_bytes: int,
    steps: int,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[str]:
    """What a user should hear before training on ``path`` (the run still goes ahead): a
    JSONL file named ``.json`` (read as one raw document), a corpus that ``steps`` steps of
    ``step_bytes`` each reuse.

    >>> data_warnings(None, step_bytes=17, steps=1)
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
    need = steps * step_bytes
    if need > total:
        out.append(
            f"the data holds {total:,} bytes and {steps} steps of {step_bytes:,} need "
            f"{need:,}: it is reused {need / total:.1f} times (reshuffled each pass); give "
            "more text (--data, --data-max-bytes) to see each byte once"
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


# -- documents and steps of variable-length training ------------------------------------------

LONG_DOCS = ("truncate", "drop", "error")
"""What ``document_steps`` does with a document longer than ``max_len`` tokens."""

_BLOCK = re.compile(rb"\n(?:[ \t]*\n)+(?=\S)")  # blank lines, then an unindented line


def split_documents(docs: list[bytes]) -> list[bytes]:
    """Each text split at blank lines followed by an unindented line (top-level blocks).

    >>> split_documents([b"import os\\n\\n\\ndef f():\\n    x = 1\\n\\n    return x\\n"])
    [b'import os', b'def f():\\n    x = 1\\n\\n    return x\\n']
    """
    return [part for doc in docs for part in _BLOCK.split(doc) if part.strip()]


@dataclass(frozen=True, slots=True)
class DocumentStep:
    """One step's documents (1-D int64: the bytes, then the 0 byte) and what was cut."""

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


def document_steps(
    tokens_per_step: int,
    seed: int = 0,
    *,
    max_len: int,
    long_docs: str = "truncate",
    min_documents: int = 1,
    path: str | Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Iterator[DocumentStep]:
    """Endless steps of whole documents, at most ``tokens_per_step`` tokens each (module
    docstring); a step holds at least ``min_documents`` documents (it goes over the token
    count if it must). Reshuffled each epoch (seed + epoch); same seed, same steps."""
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
    docs = split_documents(load_documents(path, max_bytes=max_bytes))
    where = str(path) if path is not None else "the standard library sources"
    long = [i for i, d in enumerate(docs) if len(d) > max_len]
    if long and long_docs == "error":
        raise DataError(
            f"document {long[0]} of {where} has {len(docs[long[0]])} tokens, more than the "
            f"maximum sequence length {max_len} ({len(long)} such documents): use --long-docs "
            "truncate or drop, or a larger --max-seq-len"
        )
    kept = len(docs) - (len(long) if long_docs == "drop" else 0)
    if kept < min_documents:
        raise DataError(
            f"{where} has {kept} usable documents, fewer than the {min_documents} one step "
            "needs (one per micro-batch): use more text or fewer micro-batches"
        )
    return _steps(docs, tokens_per_step, seed, max_len, long_docs, min_documents)


def _document_stream(
    docs: list[bytes], seed: int, max_len: int, long_docs: str
) -> Iterator[tuple[bytes | None, bool]]:
    """``(document, truncated)`` forever; ``(None, False)`` for a dropped one."""
    epoch = 0
    while True:
        order = list(range(len(docs)))
        random.Random(seed + epoch).shuffle(order)
        for i in order:
            doc = docs[i]
            if len(doc) <= max_len:
                yield doc, False
            elif long_docs == "drop":
                yield None, False
            else:
                yield doc[:max_len], True
        epoch += 1


def _as_ids(doc: bytes) -> torch.Tensor:
    ids = np.frombuffer(doc + bytes([SEPARATOR]), dtype=np.uint8).astype(np.int64)
    return torch.from_numpy(ids)


def _steps(
    docs: list[bytes], tokens_per_step: int, seed: int, max_len: int, long_docs: str,
    min_documents: int,
) -> Iterator[DocumentStep]:  # fmt: skip
    stream = _document_stream(docs, seed, max_len, long_docs)
    pending = next(stream)
    while True:
        chosen: list[torch.Tensor] = []
        total = truncated = dropped = 0
        while True:
            doc, cut = pending
            if doc is None:
                dropped += 1
            elif total + len(doc) > tokens_per_step and len(chosen) >= min_documents:
                break  # the next step starts with it
            else:
                chosen.append(_as_ids(doc))
                total += len(doc)
                truncated += cut
            pending = next(stream)
        yield DocumentStep(tuple(chosen), truncated=truncated, dropped=dropped)
