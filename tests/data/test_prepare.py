"""Text tokenized with a user's tokenizer: the three output formats hold the same ids, each
document ends with the end-of-document id, the cache is keyed by its inputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import hspmd.data.prepare as prepare
from hspmd.data.corpus import load_documents
from hspmd.data.errors import DataError
from hspmd.data.prepare import cached_tokens, write_tokens
from hspmd.data.tokenizer import load_tokenizer
from hspmd.data.tokens import open_token_file


def _records(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_formats_hold_the_same_documents(jsonl: Path, tokenizer_json: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_json)
    assert tokenizer.backend == "tokenizers" and tokenizer.eod_id == 1
    outs = {"megatron": "m.bin", "flat": "f.bin", "npy": "n.npy"}
    written = {
        f: write_tokens(jsonl, tokenizer, tmp_path / name, format=f) for f, name in outs.items()
    }
    assert {w.documents for w in written.values()} == {40}
    assert {w.dtype for w in written.values()} == {"uint16"}
    megatron = open_token_file(written["megatron"].path)
    docs = megatron.documents(eod_id=None)
    expected = tokenizer.encode(_records(jsonl))
    assert [docs.ids(i, None).tolist() for i in range(40)] == [ids + [1] for ids in expected]
    for f in ("flat", "npy"):
        other = open_token_file(written[f].path)
        assert np.array_equal(other.ids, megatron.ids), f
        assert other.documents(eod_id=1).lengths.tolist() == docs.lengths.tolist()


def test_eod_id_and_missing_eod(jsonl: Path, tokenizer_json: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_json)
    written = write_tokens(jsonl, tokenizer, tmp_path / "e.bin", eod_id=0)
    assert written.eod_id == 0
    assert open_token_file(tmp_path / "e.bin").ids[-1] == 0
    without = type(tokenizer)(
        tokenizer.path, tokenizer.vocab_size, None, "tokenizers", tokenizer.encode
    )
    with pytest.raises(DataError, match="no end-of-document token .* give --eod-id"):
        write_tokens(jsonl, without, tmp_path / "x.bin")
    with pytest.raises(DataError, match="--eod-id 99 is not an id of tokenizer"):
        write_tokens(jsonl, tokenizer, tmp_path / "x.bin", eod_id=99)


def test_bad_outputs_and_inputs(jsonl: Path, tokenizer_json: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_json)
    for out, fmt, message in [
        ("a.txt", None, "name a NAME.bin"),
        ("a.bin", "npy", "named NAME.npy"),
    ]:
        with pytest.raises(DataError, match=message):
            write_tokens(jsonl, tokenizer, tmp_path / out, format=fmt)
    (tmp_path / "f.idx").write_bytes(b"")
    with pytest.raises(DataError, match="would make training read f.bin as a Megatron"):
        write_tokens(jsonl, tokenizer, tmp_path / "f.bin", format="flat")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="the corpus is empty"):
        write_tokens(tmp_path / "blank.jsonl", tokenizer, tmp_path / "b.bin")
    assert not list(tmp_path.glob(".b.bin*"))  # no temporary files left
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="is not a tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")


def test_cache_is_keyed_by_the_inputs(
    jsonl: Path, tokenizer_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    first, info = cached_tokens(jsonl, tokenizer_json, cache=cache)
    assert (
        info["documents"] == 40 and info["vocab_size"] == load_tokenizer(tokenizer_json).vocab_size
    )
    calls = []
    real = prepare.load_tokenizer
    monkeypatch.setattr(prepare, "load_tokenizer", lambda p: calls.append(p) or real(p))
    assert cached_tokens(jsonl, tokenizer_json, cache=cache)[0] == first and calls == []
    keys = {first}
    keys.add(cached_tokens(jsonl, tokenizer_json, cache=cache, eod_id=0)[0])
    keys.add(cached_tokens(jsonl, tokenizer_json, cache=cache, max_bytes=100)[0])
    with jsonl.open("a") as handle:  # the text changes: size and time
        handle.write(json.dumps({"text": "the cat"}) + "\n")
    keys.add(cached_tokens(jsonl, tokenizer_json, cache=cache)[0])
    data = json.loads(tokenizer_json.read_text())  # the tokenizer changes
    data["model"]["vocab"]["zebra"] = len(data["model"]["vocab"])
    tokenizer_json.write_text(json.dumps(data))
    keys.add(cached_tokens(jsonl, tokenizer_json, cache=cache)[0])
    assert len(keys) == 5 and len(calls) == 4
    stat = jsonl.stat()  # only the time changes
    os.utime(jsonl, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert cached_tokens(jsonl, tokenizer_json, cache=cache)[0] not in keys


def test_hugging_face_folder_through_transformers(
    jsonl: Path, tokenizer_json: Path, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json), eos_token="<|endoftext|>"
    )
    fast.save_pretrained(folder)
    tokenizer = load_tokenizer(folder)
    assert tokenizer.backend == "transformers" and tokenizer.eod_id == 1
    plain = load_tokenizer(tokenizer_json)
    texts = _records(jsonl)[:5]
    assert (
        tokenizer.encode(texts) == plain.encode(texts) and tokenizer.vocab_size == plain.vocab_size
    )


@pytest.mark.parametrize(
    ("name", "raw", "words"),
    [
        ("latin1.txt", b"caf\xe9 au lait\n", r"latin1.txt: byte 0xe9 at offset 3 is not UTF-8"),
        ("l.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"l.jsonl:2: byte 0xe9 at offset 13 of the line"),
        ("f.jsonl", b'{"id": 1, "body": "x"}\n', r"f.jsonl:1: no \"text\" field \(its fields: id, body\).*jq -c '\{text: \.body\}'"),
        ("a.jsonl", b"[1, 2]\n", r"a.jsonl:1: expected a JSON object .* write each line as"),
        ("j.jsonl", b"{oops\n", r"j.jsonl:1: not JSON .*column 2"),
        ("n.jsonl", b'{"text": 3}\n', r"\"text\" must be a string, not int: give"),
    ],
)  # fmt: skip
def test_bad_text_is_one_line_and_leaves_no_partial_files(
    name: str, raw: bytes, words: str, tokenizer_json: Path, tmp_path: Path
) -> None:
    """Text that is not UTF-8 or JSONL without a string "text" is refused naming the file,
    line and fix (never decoded with replacement characters), the tokenizer's cache and the
    byte corpus alike, and a tokenization that fails half-way leaves no partial files."""
    source = tmp_path / name
    source.write_bytes(raw)
    with pytest.raises(DataError, match=words):
        cached_tokens(source, tokenizer_json, cache=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    with pytest.raises(DataError, match=words):
        load_documents(source)


def test_a_byte_order_mark_is_not_text(jsonl: Path, tokenizer_json: Path, tmp_path: Path) -> None:
    """A UTF-8 file that starts with a byte-order mark (as some editors write) reads as the
    same documents without it: JSONL (whose first line would not parse) and plain text."""
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + jsonl.read_bytes())
    plain, _ = cached_tokens(jsonl, tokenizer_json, cache=tmp_path / "cache")
    with_bom, _ = cached_tokens(marked, tokenizer_json, cache=tmp_path / "cache")
    assert np.array_equal(open_token_file(plain).ids, open_token_file(with_bom).ids)
    assert load_documents(marked) == load_documents(jsonl)
    (tmp_path / "t.txt").write_bytes(b"\xef\xbb\xbfsome text")
    assert load_documents(tmp_path / "t.txt") == [b"some text"]


def test_a_model_folder_without_a_vocabulary_is_refused(tmp_path: Path) -> None:
    """transformers builds an empty tokenizer from a model folder's config.json alone (every
    text encoded as nothing); hspmd refuses the folder in one line instead."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 64}))
    with pytest.raises(DataError, match=r"holds no tokenizer vocabulary \(none of tokenizer.json"):
        load_tokenizer(tmp_path)
