"""Tiny corpora and tokenizers for the data tests, made in ``tmp_path``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

LINES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the bird flew over the tree",
    "one two three four five six seven",
]


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    """40 documents of 3 to 21 words, one JSON record a line."""
    path = tmp_path / "corpus.jsonl"
    records = []
    for i in range(40):
        words = LINES[i % 4].split()[: 3 + i % 4] * (1 + i % 3)
        records.append(json.dumps({"text": " ".join(words), "id": i}))
    path.write_text("\n".join(records) + "\n")
    return path


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    """A WordLevel tokenizer trained on ``LINES``, with ``<|endoftext|>`` as id 1."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"])
    tokenizer.train_from_iterator(LINES, trainer)
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tokenizer.save(str(path))
    return path
