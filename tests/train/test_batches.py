"""The data of each step is a function of (seed, step) and the data flags, never of the
strategy: token files, tokenized text and the byte corpus; checked before launch; and a
run on a token file that switches, saves and resumes equals the reference."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from hspmd.data.errors import DataError
from hspmd.data.megatron import write_indexed
from hspmd.train.api import revise, train_config
from hspmd.train.batches import check_data, step_batches, step_documents
from hspmd.train.config import AdamConfig, TrainConfig

VOCAB = (("vocab_size", 64), ("num_layers", 2))


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scans and tokenizations go to the test's folder, not ~/.cache."""
    monkeypatch.setenv("HSPMD_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """A Megatron pair of 60 documents of 3 to 40 ids, each ending with id 1."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(2, 64, int(n)), 1) for n in rng.integers(3, 40, 60)]
    write_indexed(tmp_path / "docs", docs, dtype=np.uint16)
    return tmp_path / "docs.bin"


def _config(path: Path | None, **changes: object) -> TrainConfig:
    base = train_config(model_kwargs=VOCAB if path else (("num_layers", 2),), seq_len=16,
                       global_batch=4, steps=6, data=str(path) if path else None,
                       data_max_bytes=None if path else 1 << 16, data_cache=None)  # fmt: skip
    return revise(base, **changes)  # type: ignore[arg-type]


def _same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:  # fmt: skip
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                    for x, y in zip(a, b, strict=True))  # fmt: skip


@pytest.mark.parametrize("corpus", ["tokens", "bytes"])
def test_batches_do_not_depend_on_the_strategy(token_file: Path, corpus: str) -> None:
    path = token_file if corpus == "tokens" else None
    runs = [
        list(step_batches(_config(path, strategy=text)))
        for text in (None, "2x2: R0:L0-0 R1:L1-1", "1x2: R0-1:L0-1; 1x2: R2:L0-1")
    ]
    assert len(runs[0]) == 6 and _same(runs[0], runs[1]) and _same(runs[0], runs[2])
    resumed = list(step_batches(_config(path), first=4))  # a resume or a redo at step 4
    assert _same(resumed, runs[0][3:])


def test_packed_steps_do_not_depend_on_the_strategy(token_file: Path) -> None:
    config = _config(token_file, step_tokens=64, seq_len=32)
    a = list(islice(step_documents(config, min_documents=4), 5))
    b = list(islice(step_documents(revise(config, strategy="4x1: R0:L0-1"),
                                   min_documents=4), 5))  # fmt: skip
    assert [s.lengths for s in a] == [s.lengths for s in b]
    for step, other in zip(a, b, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(step.documents, other.documents, strict=True))
        assert all(int(d[-1]) == 1 or len(d) == 33 for d in step.documents)  # whole, or cut


def _word_tokenizer(lines: list[str], path: Path) -> None:
    """A WordLevel tokenizer of ``lines`` with ``</s>`` (its end of document), at ``path``."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        lines, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"])
    )
    tokenizer.save(str(path))


def test_tokenized_text_equals_the_written_token_file(tmp_path: Path) -> None:
    lines = [f"w{i % 13} w{(i * 7) % 11} w{i % 5} end" for i in range(300)]
    _word_tokenizer(lines, tmp_path / "tokenizer.json")
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines))
    from hspmd.cli import main

    assert main(["tokenize", str(tmp_path / "c.jsonl"), "--tokenizer",
                 str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "c.bin")]) == 0  # fmt: skip
    text = _config(tmp_path / "c.jsonl", tokenizer=str(tmp_path / "tokenizer.json"),
                   data_cache=str(tmp_path / "cache"))  # fmt: skip
    check_data(text)  # tokenizes into the cache
    assert list((tmp_path / "cache" / "tokens").glob("*.json"))
    assert _same(list(step_batches(text)), list(step_batches(_config(tmp_path / "c.bin"))))


def test_too_little_tokenized_text_names_the_text_not_the_cache(tmp_path: Path) -> None:
    """A text file is one document with a tokenizer: too few documents for a packed step,
    or too few tokens for a fixed one, name the user's --data and its tokenizer."""
    lines = [f"w{i % 13} w{i % 5} end" for i in range(50)]
    _word_tokenizer(lines, tmp_path / "tokenizer.json")
    (tmp_path / "one.txt").write_text("\n".join(lines))
    text = _config(tmp_path / "one.txt", tokenizer=str(tmp_path / "tokenizer.json"),
                   strategy="1x1: R0:L0-1; 1x1: R1:L0-1", global_batch=2)  # fmt: skip
    named = rf"{tmp_path / 'one.txt'} \(tokenized by {tmp_path / 'tokenizer.json'}\)"
    with pytest.raises(DataError, match=named + " has 1 usable document, fewer than the 2"):
        next(step_documents(revise(text, step_tokens=256, seq_len=128), min_documents=2))
    with pytest.raises(DataError, match=named + " holds 151 tokens, fewer than one step"):
        check_data(revise(text, seq_len=128))


def test_check_data_before_launch(token_file: Path, tmp_path: Path) -> None:
    check_data(_config(token_file, data_cache=str(tmp_path / "cache")))
    small = revise(_config(token_file), model_kwargs=(("vocab_size", 32),))
    with pytest.raises(DataError, match=r"token id \d+ at position \d+ is not below the model's vocabulary of 32"):  # fmt: skip
        check_data(small)
    with pytest.raises(DataError, match="fewer than one step of 400 x 16"):
        check_data(_config(token_file, global_batch=400))
    with pytest.raises(DataError, match="fewer than one batch needs"):
        (tmp_path / "short.txt").write_text("abc")
        check_data(_config(None, data=str(tmp_path / "short.txt")))


@pytest.mark.multiproc
def test_switch_and_resume_on_a_token_file_equal_the_reference(token_file: Path, tmp_path: Path) -> None:  # fmt: skip
    from hspmd.train.reference import run_reference
    from hspmd.train.trainer import train_many

    base = _config(token_file, steps=4, adam=AdamConfig(lr=1e-3), data_cache=str(tmp_path / "c"))
    save = str(tmp_path / "ckpt")
    cases = [
        revise(
            base, strategy="2x2: R0:L0-0 R1:L1-1", switches=((3, "1x2: R0-1:L0-1; 1x2: R2:L0-1"),)
        ),  # fmt: skip
        revise(base, strategy="4x1: R0:L0-1", steps=2, save=save, save_every=2),
        revise(base, strategy="1x2: R0-1:L0-1; 1x2: R2:L0-1", resume=save),
    ]
    results = train_many(cases, threads=1, timeout_s=300)
    reference = run_reference(base).losses
    assert results[0].losses == pytest.approx(reference, rel=1e-5)
    assert results[1].losses + results[2].losses == pytest.approx(reference, rel=1e-5)
