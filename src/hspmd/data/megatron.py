"""Megatron's indexed dataset: ``PREFIX.bin`` (the token ids of every sequence, back to back)
and ``PREFIX.idx`` (where each sequence and document starts), read memory-mapped.

The index layout (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``, "MMIDIDX"),
little-endian, nothing between the fields::

    offset          field                  type
    0               magic                  9 bytes  b"MMIDIDX\\x00\\x00"
    9               version                uint64   1
    17              dtype code             uint8    1 uint8, 2 int8, 3 int16, 4 int32,
                                                    5 int64, 6 float64, 7 float32, 8 uint16
    18              sequence count S       uint64
    26              document count D       uint64   (documents + 1: a leading 0)
    34              sizes                  int32[S]  ids of each sequence
    34 + 4S         pointers               int64[S]  byte offset of each sequence in .bin
    34 + 12S        document indices       int64[D]  first sequence of each document, then S
    (34 + 12S + 8D  sequence modes         int8[S]   only in multimodal indexes: ignored)

Document ``d`` is sequences ``doc_idx[d]`` up to ``doc_idx[d + 1]``, contiguous in ``.bin``.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp())
>>> write_indexed(folder / "c", [[5, 6, 7], [8, 9]], dtype=np.uint16)
>>> index = read_index(folder / "c.idx")
>>> index.dtype, index.sizes.tolist(), index.document_bounds()
(dtype('uint16'), [3, 2], ([0, 3], [3, 5]))
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hspmd.data.errors import DataError

__all__ = ["MAGIC", "MegatronIndex", "read_index", "write_indexed"]

MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
CODES: dict[int, type[np.integer]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16,
}  # fmt: skip
_FLOATS = {6: "float64", 7: "float32"}


@dataclass(frozen=True, slots=True, eq=False)
class MegatronIndex:
    """A read ``.idx``: the id dtype and the memory-mapped arrays (module docstring)."""

    path: Path
    dtype: np.dtype
    sizes: np.ndarray  # int32[S]
    pointers: np.ndarray  # int64[S]
    doc_idx: np.ndarray  # int64[D]

    def document_bounds(self) -> tuple[list[int], list[int]]:
        """``(starts, ends)`` of every non-empty document, in ids from the start of ``.bin``."""
        starts, ends = self.document_arrays()
        return starts.tolist(), ends.tolist()

    def document_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``document_bounds`` as int64 arrays."""
        first, last = self.doc_idx[:-1], self.doc_idx[1:]
        keep = last > first
        first, last = first[keep], last[keep] - 1
        item = self.dtype.itemsize
        starts = self.pointers[first] // item
        ends = self.pointers[last] // item + self.sizes[last].astype(np.int64)
        return starts.astype(np.int64), ends.astype(np.int64)


def read_index(path: str | Path) -> MegatronIndex:
    """The index at ``path`` (``.idx``), checked against its layout; arrays memory-mapped."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(_HEADER.size)
    if len(head) < _HEADER.size or not head.startswith(MAGIC):
        raise DataError(
            f"{path} is not a Megatron index: it does not start with {MAGIC!r} (give the "
            ".bin of a Megatron indexed dataset with its .idx beside it, or a flat token file)"
        )
    _, version, code, count, docs = _HEADER.unpack(head)
    if version != 1:
        raise DataError(f"{path}: Megatron index version {version}; this reader knows version 1")
    if code in _FLOATS or code not in CODES:
        what = _FLOATS.get(code, f"unknown code {code}")
        raise DataError(f"{path}: token dtype {what}; token ids must be integers (codes 1-5, 8)")
    need = _HEADER.size + 12 * count + 8 * docs
    if size < need:
        raise DataError(
            f"{path} holds {size} bytes, fewer than its header promises ({need}: {count} "
            f"sequences, {docs} document entries): the index is truncated; write it again"
        )
    offset = _HEADER.size
    sizes = np.memmap(path, np.int32, "r", offset, (count,)) if count else np.zeros(0, np.int32)
    offset += 4 * count
    pointers = np.memmap(path, np.int64, "r", offset, (count,)) if count else np.zeros(0, np.int64)
    offset += 8 * count
    doc_idx = np.memmap(path, np.int64, "r", offset, (docs,)) if docs else np.zeros(0, np.int64)
    if docs and (doc_idx[0] != 0 or doc_idx[-1] != count or np.any(np.diff(doc_idx) < 0)):
        raise DataError(
            f"{path}: the document indices do not run from 0 to the {count} sequences in "
            "order: the index is corrupt; write it again"
        )
    return MegatronIndex(path, np.dtype(CODES[code]), sizes, pointers, doc_idx)


def write_indexed(
    prefix: str | Path, documents: Iterable[Sequence[int] | np.ndarray], *, dtype: type
) -> None:
    """Write ``PREFIX.bin`` and ``PREFIX.idx``, one sequence per document (small corpora and
    tests; ``hspmd.data.prepare`` streams large ones through ``IndexedWriter``)."""
    with IndexedWriter(prefix, dtype=dtype) as writer:
        for doc in documents:
            writer.add(np.asarray(doc))


class IndexedWriter:
    """Streams documents into ``PREFIX.bin``; ``close`` writes ``PREFIX.idx`` (one sequence per
    document, as Megatron's preprocessing writes without sentence splitting)."""

    def __init__(self, prefix: str | Path, *, dtype: type) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        codes = {np.dtype(v): k for k, v in CODES.items()}
        if self.dtype not in codes:
            raise DataError(f"dtype {self.dtype} has no Megatron code: use uint16 or int32")
        self.code = codes[self.dtype]
        self.sizes: list[int] = []
        self.bin = Path(f"{self.prefix}.bin").open("wb")  # noqa: SIM115 (closed by close)

    def add(self, ids: np.ndarray) -> None:
        self.bin.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self.sizes.append(len(ids))

    def close(self) -> None:
        self.bin.close()
        sizes = np.array(self.sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        with Path(f"{self.prefix}.idx").open("wb") as idx:
            idx.write(_HEADER.pack(MAGIC, 1, self.code, len(sizes), len(doc_idx)))
            for array in (sizes, pointers, doc_idx):
                idx.write(array.tobytes())

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
