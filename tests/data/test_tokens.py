"""Token files: flat ids (nanoGPT), .npy; memory-mapped; split at the end-of-document id;
every id checked against the vocabulary, the first bad one named with its position."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hspmd.data.tokens as tokens
from hspmd.data.errors import DataError
from hspmd.data.tokens import check_ids, eod_bounds, open_token_file, token_format


def test_formats_by_name(tmp_path: Path) -> None:
    (tmp_path / "m.idx").write_bytes(b"")
    assert token_format(tmp_path / "a.bin") == "flat"
    assert token_format(tmp_path / "m.bin") == "megatron"  # its .idx is beside it
    assert token_format(tmp_path / "m.idx") == "megatron"
    assert token_format(tmp_path / "a.npy") == "npy"
    assert token_format(tmp_path / "a.txt") is None and token_format(tmp_path / "a.jsonl") is None


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_flat_file_is_memory_mapped(tmp_path: Path, dtype: str) -> None:
    ids = np.arange(1000, dtype=dtype) * 3
    ids.tofile(tmp_path / "train.bin")
    file = open_token_file(tmp_path / "train.bin", dtype=dtype if dtype == "uint32" else None)
    assert isinstance(file.ids, np.memmap) and file.ids.dtype == np.dtype(dtype)
    assert np.array_equal(file.ids, ids) and file.bounds is None


def test_npy_file(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.array([3, 4, 0, 5, 0], dtype=np.int32))
    file = open_token_file(tmp_path / "t.npy")
    assert file.format == "npy" and isinstance(file.ids, np.memmap)
    assert file.documents(eod_id=0).lengths.tolist() == [2, 1]


@pytest.mark.parametrize(
    ("make", "dtype", "message"),
    [
        (lambda p: p.write_bytes(b"\x01\x02\x03"), None,
         "3 bytes, not a whole number of uint16 ids .* check the file"),
        (lambda p: p.write_bytes(b"\x01\x02" * 3), "uint32",
         "6 bytes, not a whole number of uint32 ids"),
        (lambda p: p.write_bytes(b""), None, "holds no tokens: the corpus is empty"),
    ],
)  # fmt: skip
def test_bad_flat_files(tmp_path: Path, make, dtype, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.bin"
    make(path)
    with pytest.raises(DataError, match=message):
        open_token_file(path, dtype=dtype)


def test_a_size_that_fits_the_other_dtype_names_it(tmp_path: Path) -> None:
    (tmp_path / "t.bin").write_bytes(b"\x01\x00" * 3)
    with pytest.raises(DataError, match="give --data-dtype uint16"):
        open_token_file(tmp_path / "t.bin", dtype="uint32")


def test_bad_npy_files(tmp_path: Path) -> None:
    np.save(tmp_path / "2d.npy", np.zeros((2, 3), dtype=np.uint16))
    np.save(tmp_path / "float.npy", np.zeros(3, dtype=np.float32))
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype=np.uint16))
    np.save(tmp_path / "u16.npy", np.zeros(4, dtype=np.uint16))
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    for name, message in [("2d", "1-D array of integer ids"), ("float", "1-D array of integer"),
                          ("empty", "the corpus is empty"), ("junk", "not a readable .npy")]:  # fmt: skip
        with pytest.raises(DataError, match=message):
            open_token_file(tmp_path / f"{name}.npy")
    with pytest.raises(DataError, match="drop --data-dtype"):
        open_token_file(tmp_path / "u16.npy", dtype="uint32")
    with pytest.raises(DataError, match="does not exist"):
        open_token_file(tmp_path / "missing.bin")


def test_check_ids_names_the_first_bad_id_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "CHUNK", 4)  # several chunks in a tiny file
    ids = np.array([1, 2, 3, 4, 5, 6, 300, 7, 500, 8], dtype=np.uint16)
    check_ids(ids, vocab_size=501, where="f")
    with pytest.raises(DataError) as error:
        check_ids(ids, vocab_size=256, where="t.bin")
    text = str(error.value)
    assert "token id 300 at position 6 " in text and "largest id is 500" in text
    assert '"vocab_size": 501' in text
    with pytest.raises(DataError, match="token id -2 at position 5 is negative"):
        check_ids(np.array([0, 1, 2, 3, 4, -2], dtype=np.int32), vocab_size=10, where="n")


def test_eod_bounds_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "CHUNK", 3)
    ids = np.array([5, 6, 0, 7, 0, 0, 8, 9, 9, 9, 0, 4, 4], dtype=np.uint16)
    starts, ends = eod_bounds(ids, 0)
    # [5 6 0] [7 0] ([0]: one id, left out) [8 9 9 9 0] [4 4]: no end id at the end
    assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == [(0, 3), (3, 5), (6, 11), (11, 13)]  # fmt: skip


def test_documents_are_cut_to_max_len(tmp_path: Path) -> None:
    np.array([1, 2, 3, 4, 5, 0, 6, 7, 0], dtype=np.uint16).tofile(tmp_path / "t.bin")
    docs = open_token_file(tmp_path / "t.bin").documents(eod_id=0)
    assert docs.lengths.tolist() == [5, 2]
    assert docs.ids(0, 2).tolist() == [1, 2, 3] and docs.ids(1, None).tolist() == [6, 7, 0]
    assert sorted(docs.order(0, 0)) == [0, 1]
    assert list(docs.order(3, 1)) == list(docs.order(3, 1))


def test_flat_file_without_eod_cannot_give_documents(tmp_path: Path) -> None:
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(DataError, match="give --eod-id ID"):
        open_token_file(tmp_path / "t.bin").documents(eod_id=None)
