"""Which corpus a run reads, as one value (``DataSpec``), and its checks before launch.

=================================  =====================================================
``DataSpec``                       the corpus
=================================  =====================================================
no path, or a text path            the byte corpus (``hspmd.data.corpus``, vocabulary 256)
a ``.bin``, ``.idx`` or ``.npy``   a token file (``hspmd.data.tokens``)
a text path and ``tokenizer``      the text tokenized, from the cache (``hspmd.data.prepare``)
=================================  =====================================================

``check`` runs on the launcher before any worker starts: it tokenizes text into the cache
(so that ranks only read it), scans every id of a token file against the model's vocabulary,
compares the tokenizer's vocabulary with the model's and makes sure the corpus holds one
step. Ranks then ``open_tokens`` (a memory map, no scan) and draw their batches by step.

>>> DataSpec().kind, DataSpec(path="corpus.jsonl", tokenizer="tokenizer.json").kind
('bytes', 'text')
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hspmd.data.errors import DataError
from hspmd.data.prepare import Progress, cache_root, cached_tokens
from hspmd.data.tokenizer import fingerprint, load_tokenizer
from hspmd.data.tokens import (
    TOKEN_DTYPES,
    TokenDocuments,
    TokenFile,
    check_ids,
    eod_bounds,
    id_range,
    open_token_file,
)
from hspmd.data.tokens import token_format as _token_format

__all__ = [
    "DataSpec", "check_tokens", "corpus_name", "open_tokens", "spec_warnings", "token_documents", "tokenizer_vocab",
]  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec:
    """A run's data flags: ``--data``, ``--data-dtype``, ``--eod-id``, ``--tokenizer``,
    ``--data-cache``, ``--data-max-bytes`` (None: each reader's default), and ``--dataset``:
    a user's dataset of any items instead of token data, ``"FILE.py:FACTORY"``
    (``hspmd.data.items``: a map-style dataset or an iterable of tensors, tuples or dicts of
    them; docs/data.md). Loads nothing."""

    path: str | None = None
    dtype: str | None = None  # a flat token file's ids: uint16 (None) or uint32
    eod_id: int | None = None  # a token file's end-of-document id (packed steps split there)
    tokenizer: str | None = None  # tokenizer.json or a local HF folder: text is tokenized
    cache: str | None = None  # tokenizations' cache (None: $HSPMD_CACHE, ~/.cache/hspmd)
    max_bytes: int | None = None  # read at most this much text
    dataset: str | None = None

    def __post_init__(self) -> None:
        if self.eod_id is not None and self.eod_id < 0:
            raise DataError(f"--eod-id {self.eod_id}: give a token id (>= 0)")
        if self.dtype is not None and self.dtype not in TOKEN_DTYPES:
            raise DataError(f"--data-dtype {self.dtype}: choose one of {', '.join(TOKEN_DTYPES)}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise DataError(
                f"--data-max-bytes {self.max_bytes}: give a positive size in bytes (leave "
                "it out for the default)"
            )
        if self.dataset is not None and (self.path is not None or self.tokenizer is not None):
            given = "--data" if self.path is not None else "--tokenizer"
            raise DataError(
                f"--dataset {self.dataset} does not combine with {given} (token data and "
                f"sequences only): drop {given}"
            )

    @property
    def kind(self) -> Literal["bytes", "tokens", "text"]:
        """The row of the module docstring's table."""
        if self.path is not None and _token_format(self.path) is not None:
            return "tokens"
        return "text" if self.tokenizer is not None else "bytes"

    @property
    def tokenized(self) -> bool:
        """Token ids of a token file or a tokenizer, not the byte corpus."""
        return self.kind != "bytes"


def open_tokens(spec: DataSpec, *, on_progress: Progress | None = None) -> TokenFile:
    """The token file of a tokenized ``spec``, memory-mapped (text is tokenized into the
    cache first unless it is there)."""
    if spec.kind == "tokens":
        assert spec.path is not None
        return open_token_file(spec.path, dtype=spec.dtype)
    assert spec.tokenizer is not None, "the byte corpus has no token file"
    path, _ = cached_tokens(spec.path, spec.tokenizer, cache=spec.cache, eod_id=spec.eod_id,
                            max_bytes=spec.max_bytes, on_progress=on_progress)  # fmt: skip
    return open_token_file(path)


def corpus_name(spec: DataSpec, file: TokenFile) -> str:
    """How errors name a tokenized corpus: the user's ``--data``, never the cache file that
    holds its tokenization.

    >>> spec = DataSpec(path="corpus.txt", tokenizer="tok.json")
    >>> corpus_name(spec, TokenFile(Path("/cache/ab12.bin"), "megatron", np.zeros(1, np.uint16)))
    'corpus.txt (tokenized by tok.json)'
    """
    if spec.kind == "text":
        return f"{spec.path or 'the standard library sources'} (tokenized by {spec.tokenizer})"
    return str(spec.path or file.path)


def token_documents(spec: DataSpec, file: TokenFile) -> TokenDocuments:
    """The documents of ``file``: the Megatron index's, else split at the end-of-document id
    (``--eod-id``, else the tokenizer's), the split cached beside the tokenizations."""
    if file.bounds is not None:
        return TokenDocuments(file.ids, *file.bounds, where=corpus_name(spec, file))
    eod = spec.eod_id
    if eod is None and spec.tokenizer is not None:
        eod = tokenizer_vocab(spec)[1]
    if eod is None:
        return file.documents(eod_id=None)  # the error that asks for --eod-id
    cached = _scan_path(spec, file, f"documents at {eod}", ".npz")
    if cached.exists():
        with np.load(cached) as saved:
            starts, ends = saved["starts"], saved["ends"]
    else:
        starts, ends = eod_bounds(file.ids, eod)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_name(f".{cached.stem}.{os.getpid()}.npz")
            np.savez(partial, starts=starts, ends=ends)
            os.replace(partial, cached)
        except OSError:
            pass  # a read-only cache: the split is computed again next time
    return TokenDocuments(file.ids, starts, ends, where=corpus_name(spec, file))


def tokenizer_vocab(spec: DataSpec) -> tuple[int, int | None]:
    """The vocabulary size and end-of-document id of ``spec.tokenizer``, cached by its
    fingerprint (loading a tokenizer may import transformers: seconds)."""
    assert spec.tokenizer is not None
    cached = cache_root(spec.cache) / "tokenizers" / f"{fingerprint(spec.tokenizer)[:32]}.json"
    if cached.exists():
        saved = json.loads(cached.read_text())
        return int(saved["vocab_size"]), saved["eod_id"]
    tokenizer = load_tokenizer(spec.tokenizer)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f".{cached.name}.{os.getpid()}")
        partial.write_text(
            json.dumps({"vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id})
        )
        os.replace(partial, cached)
    except OSError:
        pass
    return tokenizer.vocab_size, tokenizer.eod_id


def check_tokens(
    spec: DataSpec, *, vocab_size: int, on_progress: Progress | None = None
) -> TokenFile:
    """The checks of a tokenized corpus before launch (module docstring), but the count of
    tokens a step needs (the caller's: ``hspmd.data.windows``, ``hspmd.data.steps``)."""
    if spec.tokenizer is not None:
        tokens, _ = tokenizer_vocab(spec)
        if tokens > vocab_size:
            raise DataError(
                f"tokenizer {spec.tokenizer} has a vocabulary of {tokens:,} ids, more than the "
                f"model's {vocab_size:,}: give the model a vocabulary of at least {tokens} "
                f"(--config '{{\"vocab_size\": {tokens}}}') or the tokenizer it was trained with"
            )
    if spec.eod_id is not None and spec.eod_id >= vocab_size:
        raise DataError(
            f"--eod-id {spec.eod_id} is not below the model's vocabulary of {vocab_size}: "
            "give the id the token file ends its documents with"
        )
    file = open_tokens(spec, on_progress=on_progress)
    check_ids(file.ids, vocab_size=vocab_size, where=corpus_name(spec, file),
              known=tuple(_saved(spec, file, "id range", lambda: id_range(file.ids))))  # fmt: skip
    return file


def _scan_path(spec: DataSpec, file: TokenFile, what: str, suffix: str) -> Path:
    """Where a scan of ``file`` is saved: keyed by its path, size, modification time and
    dtype, so a large file is scanned once, not at every launch."""
    stat = file.path.stat()
    key = [what, str(file.path.resolve()), stat.st_size, stat.st_mtime_ns, file.ids.dtype.str]
    name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    return cache_root(spec.cache) / "scans" / f"{name}{suffix}"


def _saved(spec: DataSpec, file: TokenFile, what: str, compute: Callable[[], Any]) -> Any:
    """``compute()``, a JSON value of a scan over ``file``, saved (``_scan_path``)."""
    cached = _scan_path(spec, file, what, ".json")
    if cached.exists():
        return json.loads(cached.read_text())
    value = compute()
    _write_quietly(cached, json.dumps(value))
    return value


def _write_quietly(path: Path, text: str) -> None:
    """Write ``path`` atomically; a read-only cache is no error (the work is done again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(text)
        os.replace(partial, path)
    except OSError:
        pass


def spec_warnings(spec: DataSpec, *, step_tokens: int, steps: int) -> list[str]:
    """What a user should hear about the data flags before training (the run goes ahead):
    flags that do nothing for this corpus, a token file that ``steps`` steps of
    ``step_tokens`` reuse, a flat uint16 file that looks like uint32 ids. The byte corpus's
    own warnings are ``hspmd.data.corpus.data_warnings``."""
    kind = spec.kind
    if kind == "bytes":
        return [
            f"{flag} {value} does nothing with the byte corpus (text without --tokenizer): "
            "give a token file (.bin, .idx, .npy) or --tokenizer"
            for flag, value in (("--data-dtype", spec.dtype), ("--eod-id", spec.eod_id))
            if value is not None
        ]
    out = []
    if spec.max_bytes is not None and kind == "tokens":
        out.append(f"--data-max-bytes {spec.max_bytes} does nothing with a token file: every id is read")  # fmt: skip
    if spec.dtype is not None and (kind == "text" or _token_format(spec.path or "") != "flat"):
        out.append(f"--data-dtype {spec.dtype} does nothing here: it is the dtype of a flat .bin file")  # fmt: skip
    if kind != "tokens":
        return out
    file = open_tokens(spec)
    if file.bounds is not None and spec.eod_id is not None:
        out.append(f"--eod-id {spec.eod_id} does nothing with a Megatron dataset: its index gives the documents")  # fmt: skip
    need = steps * step_tokens
    if step_tokens < len(file.ids) < need:  # under one step is an error (check_data)
        out.append(
            f"{spec.path} holds {len(file.ids):,} tokens and {steps} steps of {step_tokens:,} "
            f"need {need:,}: it is reused {need / len(file.ids):.1f} times (reshuffled each pass)"
        )
    head = np.asarray(file.ids[:4096])
    wide = head.dtype == np.uint16 and len(head) >= 64  # uint32 ids read as uint16?
    if file.format == "flat" and wide and not head[1::2].any() and head[0::2].any():
        out.append(
            f"{spec.path}: every second uint16 id of its first {len(head)} is 0, as in a file "
            "of uint32 ids: give --data-dtype uint32 if it is one"
        )
    return out
