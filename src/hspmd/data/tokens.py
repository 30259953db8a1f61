"""Pre-tokenized token files, memory-mapped (never read whole into memory).

===========================  ========  ===========================  ======================
file                         format    id dtype                     documents
===========================  ========  ===========================  ======================
``NAME.bin``                 flat      ``--data-dtype`` (uint16)     split at ``--eod-id``
``NAME.bin`` + ``NAME.idx``  megatron  the index's                  the index's
``NAME.npy``                 npy       the array's (1-D, integer)   split at ``--eod-id``
===========================  ========  ===========================  ======================

A flat file is nanoGPT's ``train.bin``: the ids back to back, nothing else. ``NAME.idx``
may be given for its ``.bin`` (``hspmd.data.megatron``). Every other file is text.

A document split at the end-of-document id keeps that id as its last (the target of its
last token); a document of one id (two end ids in a row) is left out.

>>> import tempfile
>>> path = Path(tempfile.mkdtemp()) / "train.bin"
>>> np.array([5, 6, 0, 7, 8, 9, 0, 4], dtype=np.uint16).tofile(path)
>>> file = open_token_file(path)
>>> file.format, len(file.ids), file.documents(eod_id=0).lengths.tolist()
('flat', 8, [2, 3])
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hspmd.data.errors import DataError
from hspmd.data.megatron import read_index

__all__ = [
    "TOKEN_DTYPES", "TokenDocuments", "TokenFile", "check_ids", "eod_bounds", "id_range",
    "open_token_file", "token_format",
]  # fmt: skip

TOKEN_DTYPES = ("uint16", "uint32")
"""The ``--data-dtype`` of a flat file (nanoGPT writes uint16; vocabularies over 65,536 need
uint32)."""

CHUNK = 1 << 24
"""Ids per chunk of a scan over a whole file (64 MiB of uint32)."""


def token_format(path: str | Path) -> str | None:
    """``"flat"``, ``"megatron"`` or ``"npy"`` by the file's name (module docstring); None
    for text."""
    path = Path(path)
    if path.suffix == ".npy":
        return "npy"
    if path.suffix == ".idx" or (path.suffix == ".bin" and path.with_suffix(".idx").exists()):
        return "megatron"
    return "flat" if path.suffix == ".bin" else None


@dataclass(frozen=True, slots=True, eq=False)
class TokenFile:
    """A token file opened (``open_token_file``): its ids, memory-mapped, and the Megatron
    index's documents."""

    path: Path  # the file of the ids (a Megatron dataset's .bin)
    format: str  # flat, megatron or npy
    ids: np.ndarray  # 1-D, memory-mapped
    bounds: tuple[np.ndarray, np.ndarray] | None = None  # megatron: (starts, ends) of documents

    def documents(self, *, eod_id: int | None) -> TokenDocuments:
        """The file's documents: the index's, else split at ``eod_id``."""
        if self.bounds is not None:
            return TokenDocuments(self.ids, *self.bounds, where=str(self.path))
        if eod_id is None:
            raise DataError(
                f"{self.path} is a {self.format} token file without document boundaries: give "
                "--eod-id ID (the end-of-document id its writer put between documents, e.g. "
                "50256 for GPT-2) to train whole documents with --tokens-per-step"
            )
        return TokenDocuments(self.ids, *eod_bounds(self.ids, eod_id), where=str(self.path))


def open_token_file(path: str | Path, *, dtype: str | None = None) -> TokenFile:
    """The token file at ``path``, memory-mapped and checked for what its size and header
    show (no scan of its ids: ``check_ids``). ``dtype``: a flat file's (default uint16); a
    ``.npy`` or Megatron file carries its own and must agree with a given one."""
    path = Path(path)
    kind = token_format(path)
    if kind is None:
        raise DataError(f"{path} is not a token file (.bin, .idx or .npy): it is read as text")
    if dtype is not None and dtype not in TOKEN_DTYPES:
        raise DataError(f"--data-dtype {dtype}: choose one of {', '.join(TOKEN_DTYPES)}")
    if not path.exists():
        raise DataError(f"token file {str(path)!r} does not exist: give a .bin, .idx or .npy file")
    if kind == "megatron":
        return _open_megatron(path, dtype)
    if kind == "npy":
        return _open_npy(path, dtype)
    return TokenFile(path, "flat", _memmap(path, np.dtype(dtype or "uint16")))


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path} holds no tokens: the corpus is empty")
    if size % dtype.itemsize:
        other = [d for d in TOKEN_DTYPES if size % np.dtype(d).itemsize == 0 and d != dtype.name]
        fix = f"give --data-dtype {other[0]} if it holds those" if other else "check the file"
        raise DataError(
            f"{path} holds {size:,} bytes, not a whole number of {dtype.name} ids "
            f"({dtype.itemsize} bytes each): it is not a flat {dtype.name} token file; {fix}"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _open_npy(path: Path, dtype: str | None) -> TokenFile:
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise DataError(f"{path} is not a readable .npy array: {error}") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise DataError(
            f"{path} holds a {ids.dtype} array of shape {ids.shape}: a token file is a 1-D "
            "array of integer ids (np.save(path, ids.astype(np.uint16)))"
        )
    _agree(path, ids.dtype, dtype)
    if len(ids) == 0:
        raise DataError(f"{path} holds no tokens: the corpus is empty")
    return TokenFile(path, "npy", ids)


def _open_megatron(path: Path, dtype: str | None) -> TokenFile:
    index = read_index(path.with_suffix(".idx"))
    data = path.with_suffix(".bin")
    if not data.exists():
        raise DataError(f"{index.path} has no {data.name} beside it: a Megatron dataset is both")
    _agree(path, index.dtype, dtype)
    ids = _memmap(data, index.dtype)
    if len(index.sizes):
        end = int(index.pointers[-1]) // index.dtype.itemsize + int(index.sizes[-1])
        if end > len(ids):
            raise DataError(
                f"{data} holds {len(ids):,} ids but its index places sequences up to id "
                f"{end:,}: the .bin is truncated or belongs to another index"
            )
    return TokenFile(data, "megatron", ids, index.document_arrays())


def _agree(path: Path, found: np.dtype, given: str | None) -> None:
    if given is not None and np.dtype(given) != found:
        raise DataError(
            f"--data-dtype {given}, but {path} holds {found} ids: drop --data-dtype (.npy and "
            "Megatron files carry their dtype)"
        )


def id_range(ids: np.ndarray) -> tuple[int, int]:
    """The smallest and largest id (one pass over the file in chunks of ``CHUNK`` ids)."""
    low, high = None, None
    for at in range(0, len(ids), CHUNK):
        chunk = np.asarray(ids[at : at + CHUNK])
        low = int(chunk.min()) if low is None else min(low, int(chunk.min()))
        high = int(chunk.max()) if high is None else max(high, int(chunk.max()))
    if low is None or high is None:
        raise DataError("no ids: the corpus is empty")
    return low, high


def check_ids(
    ids: np.ndarray, *, vocab_size: int, where: str, known: tuple[int, int] | None = None
) -> None:
    """Every id is in ``0 .. vocab_size - 1``, or the first one out of range is named with
    its position. ``known``: ``id_range(ids)`` if it was computed before (a scan saved)."""
    low, high = id_range(ids) if known is None else known
    if low >= 0 and high < vocab_size:
        return
    for at in range(0, len(ids), CHUNK):
        chunk = np.asarray(ids[at : at + CHUNK])
        bad = (chunk < 0) | (chunk >= vocab_size)
        if bad.any():
            offset = int(np.argmax(bad))
            value, position = int(chunk[offset]), at + offset
            break
    if value < 0:
        raise DataError(f"{where}: token id {value} at position {position:,} is negative")
    raise DataError(
        f"{where}: token id {value} at position {position:,} is not below the model's "
        f"vocabulary of {vocab_size} (the largest id is {high}): give a model with a "
        f"vocabulary of at least {high + 1} (--config '{{\"vocab_size\": {high + 1}}}'), "
        "or check --data-dtype"
    )


def eod_bounds(ids: np.ndarray, eod_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of the documents of ``ids`` split after each ``eod_id`` (one scan
    in chunks); documents of one id are left out."""
    found = [np.flatnonzero(np.asarray(ids[at : at + CHUNK]) == eod_id) + at
             for at in range(0, len(ids), CHUNK)]  # fmt: skip
    ends = np.concatenate([*found, np.zeros(0, np.int64)]).astype(np.int64) + 1
    if len(ends) == 0 or ends[-1] != len(ids):
        ends = np.append(ends, len(ids))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    keep = ends - starts >= 2
    return starts[keep], ends[keep]


@dataclass(frozen=True, slots=True, eq=False)
class TokenDocuments:
    """The documents of a token file as ``hspmd.data.steps.Documents``: ids read on demand,
    each epoch a permutation drawn from ``(seed, epoch)``."""

    tokens: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    where: str

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.starts - 1

    def ids(self, index: int, max_len: int | None) -> torch.Tensor:
        start, end = int(self.starts[index]), int(self.ends[index])
        if max_len is not None:
            end = min(end, start + max_len + 1)
        return torch.from_numpy(np.asarray(self.tokens[start:end]).astype(np.int64))

    def order(self, seed: int, epoch: int) -> Iterable[int]:
        return permutation(seed, epoch, len(self.starts))


def permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    """A permutation of ``range(size)`` that depends only on ``(seed, epoch, size)``."""
    return np.random.default_rng([seed % (1 << 63), epoch, size]).permutation(size)
