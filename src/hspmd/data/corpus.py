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

from hspmd.data.errors import DataError
from hspmd.data.steps import LONG_DOCS, DocumentStep, document_steps_of
from hspmd.data.tokens import token_format

__all__ = [
    "DEFAULT_MAX_BYTES",
    "EMPTY_FIX",
    "ByteDocuments",
    "batches",
    "byte_batches",
    "data_warnings",
    "document_steps",
    "documents",
    "data_files",
    "jsonl_text",
    "load_documents",
    "utf8_text",
    "split_documents",
]

DEFAULT_MAX_BYTES = 8 << 20
"""Reading stops after this many bytes of text (the default corpus is about 3-6 MB)."""

SEPARATOR = 0
"""The byte between documents."""

EMPTY_FIX = (
    " (blank JSONL lines and empty files are skipped): give --data a file or folder with text"
)
"""What an error about a corpus without text adds: where text was skipped, and the fix."""

BOM = "\ufeff"
"""The byte-order mark some editors write at a UTF-8 file's start: not text, dropped."""


def load_documents(path: str | Path | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[bytes]:  # fmt: skip
    """Documents as UTF-8 bytes, in a fixed order (module docstring).

    >>> docs = load_documents()
    >>> len(docs) > 100, min(map(len, docs)) < 2000 < max(map(len, docs))
    (True, True)
    """
    files = data_files(path)
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
        raise DataError(
            f"no text in {path or 'the standard library'}: the data is empty{EMPTY_FIX}"
        )
    return docs


def data_files(path: str | Path | None) -> list[Path]:
    """The files a corpus reads, in order: the standard library's ``*.py`` (None), the file,
    or a directory's files (sorted, recursively)."""
    if path is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(stdlib.glob("*.py"))
        if not files:
            raise DataError(f"no *.py files in the standard library at {stdlib}: give a path")
        return files
    root = Path(path)
    if not root.exists():
        raise DataError(
            f"data path {str(root)!r} does not exist: give a text file, a JSONL file "
            '(one {"text": ...} per line), a directory of text files, or a token file '
            "(.bin, .idx, .npy)"
        )
    if not root.is_dir():
        return [root]
    files = sorted(p for p in root.rglob("*") if p.is_file())
    tokens = [p for p in files if token_format(p) is not None]
    if tokens:  # their ids would be read as text (small ids are valid UTF-8)
        raise DataError(
            f"--data {path} is a folder, read as text, but holds token files "
            f"({', '.join(p.name for p in tokens[:3])}{', ...' if len(tokens) > 3 else ''}): "
            f"give one token file as --data (e.g. --data {tokens[0]}), or move them out"
        )
    return files


def utf8_text(raw: bytes, *, file: Path, number: int | None = None) -> str:
    """``raw`` decoded as UTF-8 (a file's first line without its ``BOM``); bytes that are
    not UTF-8 (a Latin-1 file, a binary file in a data directory) are one line naming the
    file, its line (``number``, JSONL) and the offset, never replaced in silence.

    >>> utf8_text(b"caf\\xc3\\xa9", file=Path("a.txt"))
    'café'
    >>> utf8_text(b"caf\\xe9", file=Path("a.txt"))
    Traceback (most recent call last):
    hspmd.data.errors.DataError: a.txt: byte 0xe9 at offset 3 is not UTF-8: hspmd reads text as UTF-8; convert the file (e.g. iconv -f LATIN1 -t UTF-8) or leave it out of the data
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        where = f"{file}:{number}" if number is not None else str(file)
        within = "of the line " if number is not None else ""
        raise DataError(
            f"{where}: byte 0x{raw[error.start]:02x} at offset {error.start} {within}is not "
            "UTF-8: hspmd reads text as UTF-8; convert the file (e.g. iconv -f LATIN1 -t "
            "UTF-8) or leave it out of the data"
        ) from None
    return text.removeprefix(BOM) if number in (None, 1) else text  # a file's first text


def jsonl_text(line: str, *, file: Path, number: int) -> str | None:
    """The ``"text"`` of one JSONL line (None for a blank line); errors name the line."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(
            f"{file}:{number}: not JSON ({error.msg} at column {error.colno}): a .jsonl file "
            'holds one {"text": ...} object per line; name a plain text file other than .jsonl'
        ) from None
    if not isinstance(record, dict):
        raise DataError(
            f'{file}:{number}: expected a JSON object with a "text" field, got '
            f'{line.strip()[:60]!r}: write each line as {{"text": ...}}'
        )
    if "text" not in record:
        strings = [k for k, v in record.items() if isinstance(v, str)] or ["FIELD"]
        raise DataError(
            f'{file}:{number}: no "text" field (its fields: {", ".join(map(str, record))}): '
            f'hspmd reads each line\'s "text"; rename the field, e.g. jq -c '
            f"'{{text: .{strings[0]}}}' {file} > fixed.jsonl"
        )
    text = record["text"]
    if not isinstance(text, str):
        raise DataError(
            f'{file}:{number}: "text" must be a string, not {type(text).__name__}: give each '
            "line's document as a JSON string"
        )
    return text


def _read_file(file: Path) -> list[bytes]:
    try:
        raw = file.read_bytes()
    except OSError as error:
        raise DataError(f"cannot read data file {str(file)!r}: {error}") from None
    if file.suffix != ".jsonl":
        utf8_text(raw, file=file)  # the bytes are the tokens, but only of UTF-8 text
        return [raw.removeprefix(BOM.encode())]
    docs = []
    for number, line in enumerate(raw.splitlines(), 1):
        text = jsonl_text(utf8_text(line, file=file, number=number), file=file, number=number)
        if text is not None:
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
    return byte_batches(load_documents(path, max_bytes=max_bytes), global_batch, seq_len, seed)


def byte_batches(
    docs: list[bytes], global_batch: int, seq_len: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` of these documents (a part of a corpus: ``hspmd.data.held_out``)."""
    if global_batch < 1 or seq_len < 1:
        raise DataError(f"{global_batch=} and {seq_len=} must both be at least 1")
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
    if need > total >= step_bytes:  # under one step is an error (hspmd.train.batches)
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

_BLOCK = re.compile(rb"\n(?:[ \t]*\n)+(?=\S)")  # blank lines, then an unindented line


def split_documents(docs: list[bytes]) -> list[bytes]:
    """Each text split at blank lines followed by an unindented line (top-level blocks).

    >>> split_documents([b"import os\\n\\n\\ndef f():\\n    x = 1\\n\\n    return x\\n"])
    [b'import os', b'def f():\\n    x = 1\\n\\n    return x\\n']
    """
    return [part for doc in docs for part in _BLOCK.split(doc) if part.strip()]


@dataclass(frozen=True, slots=True, eq=False)
class ByteDocuments:
    """UTF-8 documents as ``hspmd.data.steps.Documents``: a document of ``n`` bytes is
    ``n + 1`` ids (its bytes, then the 0 byte); epochs reshuffle with ``seed + epoch``."""

    docs: list[bytes]
    where: str

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter(map(len, self.docs), dtype=np.int64, count=len(self.docs))

    def ids(self, index: int, max_len: int | None) -> torch.Tensor:
        doc = self.docs[index] if max_len is None else self.docs[index][:max_len]
        ids = np.frombuffer(doc + bytes([SEPARATOR]), dtype=np.uint8).astype(np.int64)
        return torch.from_numpy(ids)

    def order(self, seed: int, epoch: int) -> list[int]:
        order = list(range(len(self.docs)))
        random.Random(seed + epoch).shuffle(order)
        return order


def document_steps(
    tokens_per_step: int,
    seed: int = 0,
    *,
    max_len: int,
    long_docs: str = "truncate",
    min_documents: int = 1,
    path: str | Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    texts: list[bytes] | None = None,
) -> Iterator[DocumentStep]:
    """Endless steps of whole documents, at most ``tokens_per_step`` tokens each (module
    docstring, ``hspmd.data.steps.document_steps_of``); a step holds at least
    ``min_documents`` documents (it goes over the token count if it must). Reshuffled each
    epoch (seed + epoch); same seed, same steps. ``texts``: these instead of the
    documents of ``path`` (a part of them: ``hspmd.data.held_out``)."""
    if long_docs not in LONG_DOCS:  # before reading any text
        raise DataError(f"long_docs={long_docs!r}: choose one of {', '.join(LONG_DOCS)}")
    if texts is None:
        texts = load_documents(path, max_bytes=max_bytes)
    docs = split_documents(texts)
    where = str(path) if path is not None else "the standard library sources"
    return document_steps_of(
        ByteDocuments(docs, where), tokens_per_step, seed, max_len=max_len,
        long_docs=long_docs, min_documents=min_documents,
    )  # fmt: skip
