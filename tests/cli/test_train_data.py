"""`hspmd train --data` on token files and tokenized text, and `hspmd tokenize`: bad input
is one line and exit 2 before any worker process starts; flags that do nothing warn."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hspmd.train.trainer as trainer
from hspmd.cli import build_parser, main
from hspmd.cli.train import config_from_args, warnings_of
from hspmd.data.megatron import write_indexed

STRATEGY = "2x1: R0:L0-1 R1:L2-3"
SMALL = ["--seq-len", "16", "--global-batch", "2", "--steps", "2"]


@pytest.fixture(autouse=True)
def _no_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case here must fail before a worker starts; the cache goes to tmp_path."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker process was launched")

    monkeypatch.setattr(trainer, "launch", refuse)
    monkeypatch.setenv("HSPMD_CACHE", str(tmp_path / "cache"))


def _one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hspmd "), err
    return err


def _tokenizer(folder: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"w{i}" for i in range(300)]
    tokenizer.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "<|endoftext|>"]))  # fmt: skip
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_bad_token_files_exit_2_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    ids = np.arange(2, 600, dtype=np.uint16) % 250
    ids[123] = 4000
    ids.tofile(tmp_path / "big.bin")
    err = _one_line(["train", "--strategy", STRATEGY, "--data", str(tmp_path / "big.bin"), *SMALL], capsys)  # fmt: skip
    assert "token id 4000 at position 123 is not below the model's vocabulary of 256" in err
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    err = _one_line(["train", "--strategy", STRATEGY, "--data", str(tmp_path / "odd.bin"), *SMALL], capsys)  # fmt: skip
    assert "3 bytes, not a whole number of uint16 ids" in err
    (tmp_path / "empty.bin").write_bytes(b"")
    err = _one_line(["train", "--strategy", STRATEGY, "--data", str(tmp_path / "empty.bin"), *SMALL], capsys)  # fmt: skip
    assert "the corpus is empty" in err
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "short.bin")
    err = _one_line(["train", "--strategy", STRATEGY, "--data", str(tmp_path / "short.bin"), *SMALL], capsys)  # fmt: skip
    assert "holds 20 tokens, fewer than one step of 2 x 16" in err
    packed = ["--tokens-per-step", "32", "--max-seq-len", "16"]
    err = _one_line(["train", "--strategy", STRATEGY, "--data", str(tmp_path / "short.bin"), *packed], capsys)  # fmt: skip
    assert "give --eod-id ID" in err


def test_fewer_bytes_than_one_step_is_one_line_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before this issue the byte corpus failed from a rank with a traceback
    (tmp_path / "short.txt").write_text("abc")
    err = _one_line(["train", "--strategy", STRATEGY, "--data", str(tmp_path / "short.txt"), *SMALL], capsys)  # fmt: skip
    assert "fewer than one batch needs" in err
    (tmp_path / "words.txt").write_text("plain words " * 20)  # --tokenizer forgotten
    vocab = ["--config", '{"vocab_size": 64}']
    err = _one_line(["train", "--strategy", STRATEGY, "--data", str(tmp_path / "words.txt"), *vocab, *SMALL], capsys)  # fmt: skip
    assert "words.txt is read as raw bytes (no --tokenizer) and holds byte 119" in err


def test_tokenizer_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = _tokenizer(tmp_path)
    (tmp_path / "c.jsonl").write_text('{"text": "w1 w2 w3"}\n')
    base = ["train", "--strategy", STRATEGY, "--tokenizer", str(tokenizer), *SMALL]
    err = _one_line([*base, "--data", str(tmp_path / "c.jsonl")], capsys)
    assert "has a vocabulary of 302 ids, more than the model's 256" in err
    (tmp_path / "blank.jsonl").write_text("\n")
    vocab = ["--config", '{"vocab_size": 302}']
    err = _one_line([*base, *vocab, "--data", str(tmp_path / "blank.jsonl")], capsys)
    assert "the corpus is empty" in err
    err = _one_line([*base, *vocab, "--data", str(tmp_path / "c.jsonl")], capsys)
    assert "fewer than one step of 2 x 16" in err
    err = _one_line(["train", "--tokenizer", str(tmp_path / "nope.json"), "--reference"], capsys)
    assert "--tokenizer" in err and "does not exist" in err
    (tmp_path / "latin1.txt").write_bytes(b"w1 w2 caf\xe9\n" * 40)
    (tmp_path / "content.jsonl").write_text('{"content": "w1 w2"}\n')
    err = _one_line([*base, *vocab, "--data", str(tmp_path / "latin1.txt")], capsys)
    assert "latin1.txt: byte 0xe9 at offset 9 is not UTF-8" in err
    no_tokenizer = [*base[:3], *base[5:]]  # the byte corpus reads JSONL too
    err = _one_line([*no_tokenizer, "--data", str(tmp_path / "content.jsonl")], capsys)
    assert 'content.jsonl:1: no "text" field (its fields: content)' in err
    assert main(["tokenize", str(tmp_path / "latin1.txt"), "--tokenizer", str(tokenizer),
                 "--out", str(tmp_path / "l.bin")]) == 2  # fmt: skip
    assert "not UTF-8" in capsys.readouterr().err and not list(tmp_path.glob("*l.bin*"))


def test_tokenize_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = _tokenizer(tmp_path)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": f"w{i} w{i + 1}"}) for i in range(50)))  # fmt: skip
    argv = ["tokenize", str(tmp_path / "c.jsonl"), "--tokenizer", str(tokenizer)]
    assert main([*argv, "--out", str(tmp_path / "c.bin")]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "50 documents, 150 tokens (uint16)" in out and "--data" in out
    assert (tmp_path / "c.idx").exists()
    assert main([*argv, "--out", str(tmp_path / "f.bin"), "--format", "flat", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["format"] == "flat" and record["eod_id"] == 1 and record["tokens"] == 150
    err = _one_line([*argv, "--out", str(tmp_path / "c.txt")], capsys)
    assert "name a NAME.bin" in err
    err = _one_line([*argv, "--out", str(tmp_path / "no" / "c.bin")], capsys)
    assert "does not exist" in err


def test_flags_that_do_nothing_warn(tmp_path: Path) -> None:
    write_indexed(tmp_path / "m", [[2, 3, 1]] * 40, dtype=np.uint16)
    np.arange(1, 200, dtype=np.uint32).tofile(tmp_path / "wide.bin")

    def words(*argv: str) -> str:
        args = build_parser().parse_args(["train", *argv])
        return " ".join(warnings_of(args, config_from_args(args)))

    assert "--eod-id 3 does nothing with the byte corpus" in words("--eod-id", "3")
    text = words("--data", str(tmp_path / "m.bin"), "--eod-id", "1", "--data-max-bytes", "9")
    assert "--eod-id 1 does nothing with a Megatron" in text
    assert "--data-max-bytes 9 does nothing with a token file" in text
    assert "it is reused" in words(
        "--data", str(tmp_path / "m.bin"), "--seq-len", "16", "--global-batch", "2"
    )
    assert "give --data-dtype uint32" in words(
        "--data", str(tmp_path / "wide.bin"), "--seq-len", "8"
    )
