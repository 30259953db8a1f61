"""A user's tokenizer, loaded offline: a ``tokenizer.json`` file (the ``tokenizers``
package) or a local Hugging Face tokenizer folder (``transformers.AutoTokenizer``,
``local_files_only``, no remote code). Both packages are imported here only, when a
tokenizer is given; the rest of hspmd needs neither.

Texts are encoded as the tokenizer encodes them by default (its special tokens included,
e.g. a Llama tokenizer's beginning-of-text), with no truncation; the end-of-document id
(``eod_id``: the tokenizer's end-of-sequence token, or ``--eod-id``) is appended by the
writer (``hspmd.data.prepare``).

``fingerprint`` hashes the tokenizer's files (not weights beside them): the key of cached
tokenizations.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hspmd.data.errors import DataError

__all__ = [
    "EOD_TOKENS",
    "VOCABULARY_FILES",
    "TextTokenizer",
    "fingerprint",
    "load_tokenizer",
    "tokenizer_files",
]

EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
"""End-of-document tokens of common tokenizers, tried in order when none is configured."""
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model", "tekken.json")  # fmt: skip
"""Files that hold a Hugging Face tokenizer's vocabulary (one at least, or a ``.tiktoken``)."""
# files in a model folder that are no part of its tokenizer
_NOT_TOKENIZER = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                  ".onnx", ".npz", ".npy"}  # fmt: skip


@dataclass(frozen=True, slots=True, eq=False)
class TextTokenizer:
    """A loaded tokenizer: its vocabulary (added tokens included), end-of-document id (None
    when it has none) and a batch encoder."""

    path: str
    vocab_size: int
    eod_id: int | None
    backend: str  # "tokenizers" or "transformers"
    encode: Callable[[list[str]], list[list[int]]]


def tokenizer_files(path: str | Path) -> list[Path]:
    """The files that make the tokenizer at ``path``: the file itself (with the
    ``tokenizer_config.json`` and ``special_tokens_map.json`` beside a ``tokenizer.json``),
    or a folder's files but weights, sorted."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"--tokenizer {str(path)!r} does not exist: give a tokenizer.json file or a local "
            "Hugging Face tokenizer folder"
        )
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.suffix not in _NOT_TOKENIZER)
    beside = [path.with_name(n) for n in ("tokenizer_config.json", "special_tokens_map.json")]
    return [path, *(p for p in beside if path.name == "tokenizer.json" and p.exists())]


def fingerprint(path: str | Path) -> str:
    """sha256 over the names and bytes of ``tokenizer_files(path)``."""
    digest = hashlib.sha256()
    for file in tokenizer_files(path):
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer at ``path`` (module docstring); one-line errors when it cannot load."""
    tokenizer_files(path)  # it exists
    path = Path(path)
    if path.is_dir():
        _check_vocabulary_files(path)
        try:
            return _transformers(path)
        except ImportError:
            if not (path / "tokenizer.json").exists():
                raise DataError(
                    f"--tokenizer {path}: a folder without tokenizer.json needs the "
                    "transformers package: pip install transformers (or give a tokenizer.json)"
                ) from None
            return _tokenizers(path / "tokenizer.json")
    return _tokenizers(path)


def _check_vocabulary_files(folder: Path) -> None:
    """A folder must hold a vocabulary (``VOCABULARY_FILES``): given a model folder without
    one, transformers builds an empty tokenizer from config.json's model type, which
    encodes every text as nothing."""
    names = {p.name for p in folder.iterdir() if p.is_file()}
    if not names & set(VOCABULARY_FILES) and not any(n.endswith(".tiktoken") for n in names):
        raise DataError(
            f"--tokenizer {folder} holds no tokenizer vocabulary (none of "
            f"{', '.join(VOCABULARY_FILES)}): give the folder the tokenizer's save_pretrained "
            "wrote, or its tokenizer.json"
        )


def _tokenizers(file: Path) -> TextTokenizer:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(
            f"--tokenizer {file} needs the tokenizers package: pip install tokenizers"
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:  # the Rust side raises its own Exception type
        raise DataError(
            f"--tokenizer {file} is not a tokenizer.json: {_first_line(error)}"
        ) from None
    tokenizer.no_truncation()
    tokenizer.no_padding()

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=True)]

    eod = _configured_eod(file.parent) if file.name == "tokenizer.json" else None
    ids = [tokenizer.token_to_id(t) for t in ([eod] if eod else []) + list(EOD_TOKENS)]
    eod_id = next((i for i in ids if i is not None), None)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return TextTokenizer(str(file), vocab, eod_id, "tokenizers", encode)


def _configured_eod(folder: Path) -> str | None:
    """The ``eos_token`` of ``tokenizer_config.json`` or ``special_tokens_map.json``."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            token: Any = json.loads((folder / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            return token
    return None


def _transformers(folder: Path) -> TextTokenizer:
    from transformers import AutoTokenizer  # ImportError: the caller falls back

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise DataError(
            f"--tokenizer {folder}: transformers cannot load a tokenizer from this folder "
            f"offline: {_first_line(error)}"
        ) from None

    def encode(texts: list[str]) -> list[list[int]]:
        out = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
        return [list(ids) for ids in out]

    eod_id = tokenizer.eos_token_id
    return TextTokenizer(str(folder), len(tokenizer), eod_id, "transformers", encode)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
