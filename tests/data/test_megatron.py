"""Megatron's indexed dataset: the published MMIDIDX layout read byte for byte, documents
of several sequences, and one-line errors for broken files."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from hspmd.data.errors import DataError
from hspmd.data.megatron import read_index, write_indexed
from hspmd.data.tokens import open_token_file


def _write_by_hand(prefix: Path, sequences: list[list[int]], doc_idx: list[int], code: int,
                   dtype: type) -> None:  # fmt: skip
    """An index written field by field from the published layout, independently of ours."""
    sizes = [len(s) for s in sequences]
    item = np.dtype(dtype).itemsize
    pointers = np.cumsum([0, *sizes[:-1]]) * item
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.array(sizes, dtype=np.int32).tobytes())
        f.write(np.array(pointers, dtype=np.int64).tobytes())
        f.write(np.array(doc_idx, dtype=np.int64).tobytes())
    np.concatenate([np.array(s, dtype=dtype) for s in sequences]).tofile(f"{prefix}.bin")


def test_reads_the_published_layout_with_multi_sequence_documents(tmp_path: Path) -> None:
    # three documents: sequences 0-1, sequence 2, sequences 3-5 (sentences, as Megatron
    # splits them with --split-sentences); int32 ids (code 4)
    sequences = [[1, 2], [3], [4, 5, 6], [7], [8, 9], [10]]
    _write_by_hand(tmp_path / "d", sequences, [0, 2, 3, 6], code=4, dtype=np.int32)
    index = read_index(tmp_path / "d.idx")
    assert index.dtype == np.int32 and index.sizes.tolist() == [2, 1, 3, 1, 2, 1]
    assert index.document_bounds() == ([0, 3, 6], [3, 6, 10])
    file = open_token_file(tmp_path / "d.bin")
    assert file.format == "megatron" and isinstance(file.ids, np.memmap)
    docs = file.documents(eod_id=None)
    assert [docs.ids(i, None).tolist() for i in range(3)] == [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]]
    assert open_token_file(tmp_path / "d.idx").path == tmp_path / "d.bin"  # .idx given


def test_our_writer_matches_the_layout(tmp_path: Path) -> None:
    write_indexed(tmp_path / "ours", [[5, 6, 7], [8, 9]], dtype=np.uint16)
    _write_by_hand(tmp_path / "hand", [[5, 6, 7], [8, 9]], [0, 1, 2], code=8, dtype=np.uint16)
    for suffix in (".idx", ".bin"):
        ours = (tmp_path / f"ours{suffix}").read_bytes()
        assert ours == (tmp_path / f"hand{suffix}").read_bytes(), suffix


def test_empty_documents_are_left_out(tmp_path: Path) -> None:
    _write_by_hand(tmp_path / "d", [[1, 2], [3, 4]], [0, 1, 1, 2], code=8, dtype=np.uint16)
    assert read_index(tmp_path / "d.idx").document_bounds() == ([0, 2], [2, 4])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("magic", "is not a Megatron index"),
        ("float", "token dtype float32"),
        ("version", "version 2"),
        ("truncated index", "the index is truncated"),
        ("truncated bin", "the .bin is truncated"),
        ("no bin", "has no d.bin beside it"),
        ("doc order", "the index is corrupt"),
    ],
)
def test_broken_files_are_one_line(tmp_path: Path, damage: str, message: str) -> None:
    _write_by_hand(tmp_path / "d", [[1, 2, 3], [4, 5]], [0, 1, 2], code=8, dtype=np.uint16)
    idx, bin_ = tmp_path / "d.idx", tmp_path / "d.bin"
    raw = bytearray(idx.read_bytes())
    if damage == "magic":
        raw[:3] = b"XYZ"
    elif damage == "float":
        raw[17] = 7
    elif damage == "version":
        raw[9] = 2
    elif damage == "truncated index":
        raw = raw[:-5]
    elif damage == "doc order":
        raw[-8:] = struct.pack("<q", 7)
    idx.write_bytes(bytes(raw))
    if damage == "truncated bin":
        bin_.write_bytes(bin_.read_bytes()[:6])
    if damage == "no bin":
        bin_.unlink()
    with pytest.raises(DataError, match=message) as error:
        open_token_file(idx)
    assert "\n" not in str(error.value)
