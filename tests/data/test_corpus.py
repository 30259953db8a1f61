"""Byte-level data: default stdlib corpus, user files, determinism, clear errors."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from hspmd.data import DataError, batches, data_warnings, documents, load_documents


def test_default_corpus_batches() -> None:
    tokens, targets = next(batches(8, 64, seed=0, max_bytes=1 << 20))
    assert tokens.shape == targets.shape == (8, 64)
    assert tokens.dtype == targets.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 256


def test_deterministic_from_seed() -> None:
    a = list(islice(batches(4, 32, seed=1, max_bytes=1 << 20), 3))
    b = list(islice(batches(4, 32, seed=1, max_bytes=1 << 20), 3))
    c = next(batches(4, 32, seed=2, max_bytes=1 << 20))
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], c[0])


def test_text_file_and_epochs(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij" * 3)
    stream = batches(2, 4, seed=0, path=path)
    first = [next(stream) for _ in range(6)]  # 31 bytes -> 3 batches per epoch, then again
    assert bytes(first[0][0][0].tolist() + [first[0][1][0, -1].item()]) == b"abcde"
    assert all(torch.equal(x[0], y[0]) for x, y in zip(first[:3], first[3:], strict=True))


def test_jsonl_and_directory(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    jsonl = tmp_path / "d" / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate("xyz")))
    (tmp_path / "d" / "b.txt").write_text("hello")
    assert load_documents(jsonl) == [b"x", b"y", b"z"]
    assert load_documents(tmp_path / "d") == [b"x", b"y", b"z", b"hello"]
    docs = [bytes(d.tolist()) for d in documents(0, path=tmp_path / "d", max_len=3)]
    assert sorted(docs) == [b"hel", b"x", b"y", b"z"]


def test_mixed_length_documents() -> None:
    lengths = [len(d) for d in islice(documents(0, max_bytes=1 << 20), 40)]
    assert max(lengths) > 10 * min(lengths)


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_documents(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_documents(tmp_path / "empty.txt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: .*\"text\" field"):
        load_documents(bad)
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(DataError, match="fewer than one batch"):
        batches(2, 8, path=short)
    with pytest.raises(DataError, match="seq_len=0"):
        batches(2, 0)
    folder = tmp_path / "shards"  # token ids of small values are valid UTF-8 text
    folder.mkdir()
    (folder / "a.txt").write_text("text")
    np.arange(40, dtype=np.uint16).tofile(folder / "train.bin")
    with pytest.raises(DataError, match=r"holds token files \(train.bin\): give one token file as --data"):  # fmt: skip
        load_documents(folder)


def test_jsonl_named_json_is_warned(tmp_path: Path) -> None:
    lines = [json.dumps({"text": "a" * 50}), json.dumps({"text": "b" * 50})]
    (tmp_path / "docs.json").write_text("\n".join(lines))
    (tmp_path / "plain.json").write_text(json.dumps({"config": [1, 2]}, indent=1))
    (warning,) = data_warnings(tmp_path / "docs.json", step_bytes=5, steps=1)
    assert "named .json" in warning and "rename it to .jsonl" in warning
    assert data_warnings(tmp_path / "plain.json", step_bytes=5, steps=1) == []


def test_reused_corpus_is_warned(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("x" * 99)  # 100 bytes with the separator
    assert data_warnings(tmp_path / "t.txt", step_bytes=20, steps=5) == []
    (warning,) = data_warnings(tmp_path / "t.txt", step_bytes=20, steps=6)
    assert "reused 1.2 times" in warning


# -- documents and steps of variable-length training


def test_document_steps_default_corpus_long_tailed() -> None:
    from hspmd.data import document_steps, split_documents

    lengths = sorted(len(d) for d in split_documents(load_documents(max_bytes=1 << 20)))
    assert lengths[len(lengths) // 2] * 10 < lengths[-1]  # long-tailed
    steps = list(islice(document_steps(4096, seed=3, max_len=512, max_bytes=1 << 20), 4))
    again = list(islice(document_steps(4096, seed=3, max_len=512, max_bytes=1 << 20), 4))
    for step, other in zip(steps, again, strict=True):
        assert step.lengths == other.lengths and step.tokens <= 4096
        assert max(step.lengths) <= 512
        assert all(int(d[-1]) == 0 for d in step.documents)  # the separator ends each
    assert sum(s.truncated for s in steps) > 0


def test_long_docs_policies_and_errors(tmp_path: Path) -> None:
    from hspmd.data import document_steps

    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["a" * 5, "b" * 50, "c" * 7]))
    steps = document_steps(40, max_len=20, long_docs="drop", path=path)
    step = next(steps)
    assert set(step.lengths) == {5, 7} and step.dropped >= 1 and step.truncated == 0
    cut = next(document_steps(40, max_len=20, path=path))
    assert 20 in cut.lengths and cut.truncated == 1
    with pytest.raises(DataError, match="more than the maximum sequence length 20"):
        document_steps(40, max_len=20, long_docs="error", path=path)
    with pytest.raises(DataError, match="fewer than the 5 one step needs"):
        document_steps(40, max_len=20, min_documents=5, path=path)
    many = next(document_steps(20, max_len=20, min_documents=3, path=path))
    assert len(many.documents) == 3  # over the token count rather than too few documents
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        document_steps(40, max_len=20, path=empty)
