"""The global batch of each step: ``(tokens, targets)`` of shape (global_batch, seq_len).

Every rank and the reference draw the same global batch for a step from the seed, then
take their rows; so data never depends on the plan. The corpus is ``hspmd.data``'s when
that module is available, else a stand-in: the bytes of the Python standard library's
own ``.py`` files (sorted, first 2 MiB), or the user's ``--data`` file.

>>> tokens, targets = global_batch(corpus_bytes(None), step=1, seed=0, batch=2, seq_len=4)
>>> tokens.shape, bool((tokens[:, 1:] == targets[:, :-1]).all())
(torch.Size([2, 4]), True)
"""

from __future__ import annotations

import functools
import json
import sysconfig
from pathlib import Path

import torch

from hspmd.train.config import TrainError

__all__ = ["corpus_bytes", "global_batch", "rows_of"]

_STDLIB_LIMIT = 2 << 20


@functools.cache
def corpus_bytes(path: str | None) -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor (bytes are tokens of the byte-level vocabulary)."""
    if path is None:
        data = _stdlib_bytes()
    else:
        file = Path(path)
        if not file.is_file():
            raise TrainError(f"--data {path!r} is not a file: give a text or JSONL file")
        data = file.read_bytes()
        if file.suffix == ".jsonl":
            data = b"\n".join(
                str(json.loads(line).get("text", "")).encode()
                for line in data.splitlines()
                if line.strip()
            )
    if len(data) < 2:
        raise TrainError(f"corpus {path or 'stdlib'!r} has {len(data)} bytes: too short")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _stdlib_bytes() -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for file in sorted(root.glob("*.py")):
        chunk = file.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
        if total >= _STDLIB_LIMIT:
            break
    return b"".join(chunks)


def global_batch(
    corpus: torch.Tensor, *, step: int, seed: int, batch: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``seq_len + 1`` bytes, drawn from ``(seed, step)`` only."""
    if corpus.numel() <= seq_len + 1:
        raise TrainError(
            f"corpus of {corpus.numel()} bytes is shorter than seq_len + 1 = {seq_len + 1}"
        )
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=generator)
    windows = torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def rows_of(tensor: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Rows ``first .. first + count`` of a global batch tensor (a micro-batch)."""
    return tensor[first : first + count]
