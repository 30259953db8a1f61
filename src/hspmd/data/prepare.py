"""Text tokenized once into a token file (``hspmd tokenize``), and the cache of tokenized
text that ``hspmd train --tokenizer`` reads.

The texts are read as the byte corpus reads them (``hspmd.data.corpus``: a JSONL record is
one document, any other file one document, a directory its files sorted), streamed, encoded
in batches, and written as each document's ids followed by the end-of-document id::

    format     files                  id dtype (vocabulary <= 65,536 / more)
    megatron   NAME.bin + NAME.idx    uint16 / int32     one sequence per document
    flat       NAME.bin               uint16 / uint32    train with --eod-id to split it
    npy        NAME.npy               uint16 / uint32    likewise

``cached_tokens`` keys a tokenization by a hash of its inputs: each text file's path, size
and modification time, the tokenizer's files (``tokenizer.fingerprint``), the
end-of-document id and the byte limit. The entry (a Megatron pair and a JSON of what it
holds) is written under a temporary name and renamed, so concurrent runs never read half
of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hspmd.data.corpus import EMPTY_FIX, data_files, jsonl_text, utf8_text
from hspmd.data.errors import DataError
from hspmd.data.megatron import IndexedWriter
from hspmd.data.tokenizer import EOD_TOKENS, TextTokenizer, fingerprint, load_tokenizer

__all__ = ["FORMATS", "Written", "cache_root", "cached_tokens", "iter_texts", "write_tokens"]

FORMATS = ("megatron", "flat", "npy")
_BATCH_BYTES = 1 << 20  # text encoded per call of the tokenizer
_VERSION = 2  # of the cache's layout and encoding rules (2: text is strict UTF-8)

Progress = Callable[[int, int], None]
"""``(bytes read, bytes in all)``."""


@dataclass(frozen=True, slots=True)
class Written:
    """What a tokenization wrote."""

    path: str  # the .bin or .npy (a Megatron pair's .bin)
    format: str
    documents: int
    tokens: int
    dtype: str
    vocab_size: int
    eod_id: int
    seconds: float = 0.0

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def cache_root(cache: str | Path | None = None) -> Path:
    """``cache``, else ``$HSPMD_CACHE``, else ``$XDG_CACHE_HOME/hspmd`` (``~/.cache/hspmd``)."""
    if cache is not None:
        return Path(cache)
    if os.environ.get("HSPMD_CACHE"):
        return Path(os.environ["HSPMD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hspmd"


def iter_texts(path: str | Path | None, *, max_bytes: int | None = None) -> Iterator[tuple[str, int]]:  # fmt: skip
    """``(document text, bytes read so far)``, streamed (a JSONL file line by line); reading
    stops after the file or line that reaches ``max_bytes``; empty documents are skipped."""
    done = 0
    for file in data_files(path):
        try:
            with file.open("rb") as handle:
                if file.suffix != ".jsonl":
                    raw = handle.read()
                    done += len(raw)
                    if raw:
                        yield utf8_text(raw, file=file), done
                else:
                    for number, line in enumerate(handle, 1):
                        done += len(line)
                        decoded = utf8_text(line, file=file, number=number)
                        text = jsonl_text(decoded, file=file, number=number)
                        if text:
                            yield text, done
                        if max_bytes is not None and done >= max_bytes:
                            return
        except OSError as error:
            raise DataError(f"cannot read data file {str(file)!r}: {error}") from None
        if max_bytes is not None and done >= max_bytes:
            return


def _total_bytes(path: str | Path | None, max_bytes: int | None) -> int:
    total = sum(f.stat().st_size for f in data_files(path))
    return total if max_bytes is None else min(total, max_bytes)


def output_format(out: str | Path, format: str | None) -> str:
    """The format of ``out``: ``format``, else by its suffix (``.npy``: npy, ``.bin``:
    megatron); the suffix must be one a reader takes (hspmd.data.tokens)."""
    out = Path(out)
    chosen = format or {".npy": "npy", ".bin": "megatron"}.get(out.suffix)
    if chosen not in FORMATS:
        raise DataError(
            f"--out {out}: name a NAME.bin (a Megatron .bin + .idx pair, or with --format "
            "flat nanoGPT's flat ids) or a NAME.npy"
        )
    want = ".npy" if chosen == "npy" else ".bin"
    if out.suffix != want:
        raise DataError(f"--out {out}: a {chosen} token file is named NAME{want}, so that training reads it as one")  # fmt: skip
    if chosen == "flat" and out.with_suffix(".idx").exists():
        raise DataError(
            f"--out {out} --format flat: {out.with_suffix('.idx')} beside it would make "
            f"training read {out.name} as a Megatron dataset; remove it or pick another name"
        )
    return chosen


def write_tokens(
    source: str | Path | None,
    tokenizer: TextTokenizer,
    out: str | Path,
    *,
    format: str | None = None,
    eod_id: int | None = None,
    max_bytes: int | None = None,
    on_progress: Progress | None = None,
) -> Written:
    """Tokenize the texts of ``source`` (module docstring) into ``out``."""
    start = time.perf_counter()
    out = Path(out)
    chosen = output_format(out, format)
    eod = resolve_eod(tokenizer, eod_id)
    total = _total_bytes(source, max_bytes)
    wide = tokenizer.vocab_size > 1 << 16
    dtype = (np.int32 if chosen == "megatron" else np.uint32) if wide else np.uint16
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    documents = tokens = 0
    try:
        with IndexedWriter(tmp, dtype=dtype) as writer:
            for batch, done in _batches(iter_texts(source, max_bytes=max_bytes)):
                for ids in tokenizer.encode(batch):
                    if not ids or ids[-1] != eod:
                        ids = [*ids, eod]
                    writer.add(np.asarray(ids))
                    documents += 1
                    tokens += len(ids)
                if on_progress is not None:
                    on_progress(done, total)
    except BaseException:  # a bad line half-way (DataError), ^C: leave no partial files
        _remove(tmp)
        raise
    if documents == 0:
        _remove(tmp)
        raise DataError(
            f"no text in {source or 'the standard library'}: the corpus is empty{EMPTY_FIX}"
        )
    _finish(tmp, out, chosen, np.dtype(dtype))
    return Written(str(out), chosen, documents, tokens, np.dtype(dtype).name,
                   tokenizer.vocab_size, eod, time.perf_counter() - start)  # fmt: skip


def resolve_eod(tokenizer: TextTokenizer, eod_id: int | None) -> int:
    """``eod_id``, else the tokenizer's end-of-document id; checked against its vocabulary."""
    eod = tokenizer.eod_id if eod_id is None else eod_id
    if eod is None:
        raise DataError(
            f"tokenizer {tokenizer.path} has no end-of-document token (no eos_token, none of "
            f"{', '.join(EOD_TOKENS)}): give --eod-id ID"
        )
    if not 0 <= eod < tokenizer.vocab_size:
        raise DataError(
            f"--eod-id {eod} is not an id of tokenizer {tokenizer.path} (vocabulary "
            f"{tokenizer.vocab_size}): give an id below {tokenizer.vocab_size}"
        )
    return eod


def _batches(texts: Iterator[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    batch: list[str] = []
    size = done = 0
    for text, done in texts:
        batch.append(text)
        size += len(text)
        if size >= _BATCH_BYTES:
            yield batch, done
            batch, size = [], 0
    if batch:
        yield batch, done


def _finish(tmp: Path, out: Path, chosen: str, dtype: np.dtype) -> None:
    """Move the written pair at ``tmp`` to ``out`` in its format."""
    tmp_bin, tmp_idx = Path(f"{tmp}.bin"), Path(f"{tmp}.idx")
    if chosen == "megatron":
        os.replace(tmp_idx, out.with_suffix(".idx"))
        os.replace(tmp_bin, out)
        return
    tmp_idx.unlink()
    if chosen == "flat":
        os.replace(tmp_bin, out)
        return
    flat = np.memmap(tmp_bin, dtype=dtype, mode="r")
    partial = out.with_name(f".{out.name}.{os.getpid()}.npy")
    array = np.lib.format.open_memmap(partial, mode="w+", dtype=dtype, shape=(len(flat),))
    for at in range(0, len(flat), 1 << 24):
        array[at : at + (1 << 24)] = flat[at : at + (1 << 24)]
    array.flush()
    del array, flat
    os.replace(partial, out)
    tmp_bin.unlink()


def _remove(tmp: Path) -> None:
    for suffix in (".bin", ".idx"):
        Path(f"{tmp}{suffix}").unlink(missing_ok=True)


# -- the cache of `train --tokenizer` -----------------------------------------------------------


def cache_key(source: str | Path | None, tokenizer: str | Path, *, eod_id: int | None,
              max_bytes: int | None) -> str:  # fmt: skip
    """The hash that names a tokenization (module docstring)."""
    inputs = []
    for file in data_files(source):
        stat = file.stat()
        inputs.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns])
    key = {"version": _VERSION, "inputs": inputs, "tokenizer": fingerprint(tokenizer),
           "eod_id": eod_id, "max_bytes": max_bytes}  # fmt: skip
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def cached_tokens(
    source: str | Path | None,
    tokenizer: str | Path,
    *,
    cache: str | Path | None = None,
    eod_id: int | None = None,
    max_bytes: int | None = None,
    on_progress: Progress | None = None,
) -> tuple[Path, dict[str, object]]:
    """The Megatron ``.bin`` of the tokenization of ``source`` and what it holds (a
    ``Written`` as a dict), tokenized now unless the cache already has it."""
    folder = cache_root(cache) / "tokens"
    key = cache_key(source, tokenizer, eod_id=eod_id, max_bytes=max_bytes)
    meta = folder / f"{key}.json"
    if meta.exists():
        return folder / f"{key}.bin", json.loads(meta.read_text())
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(
            f"cannot write the tokenization cache in {folder} ({error.strerror or error}): give "
            "a writable --data-cache DIR (or $HSPMD_CACHE)"
        ) from None
    written = write_tokens(source, load_tokenizer(tokenizer), folder / f"{key}.bin",
                           format="megatron", eod_id=eod_id, max_bytes=max_bytes,
                           on_progress=on_progress)  # fmt: skip
    info = written.to_json() | {"source": str(source) if source else None,
                                "tokenizer": str(tokenizer)}  # fmt: skip
    partial = meta.with_name(f".{meta.name}.{os.getpid()}")
    partial.write_text(json.dumps(info, indent=1))
    os.replace(partial, meta)
    return folder / f"{key}.bin", info
