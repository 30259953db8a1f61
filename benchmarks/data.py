"""The data path's tokens/s next to the training step's own, side by side in one run.

A token file (flat uint16 ids, memory-mapped, written once in a temporary folder: random
ids with an end-of-document id closing documents of long-tailed lengths) feeds two runs of
the same model on this machine:

    fixed     TokenWindows.batch(step): the global batch every rank draws for a step
    packed    packed_steps: the step's whole documents (--tokens-per-step), dispatched and
              packed into the strategy's micro-batches, as every rank computes them

Each data row is the median over fresh steps (no step read twice) of the data path alone;
its step row is hspmd's training step on that data (one rank; a step record's seconds do
not include drawing the data). The ratio is data seconds over step seconds per step, i.e.
step tokens/s over data tokens/s (goal: at most 0.02). The file is in the page cache (it
was just written): a cold read from disk is the disk's speed, not this code's.

    .venv/bin/python benchmarks/data.py                      # llama-tiny on CPU, ~1 minute
    .venv/bin/python benchmarks/data.py --model llama-small --seq-len 1024 --device cuda

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from hspmd.data.tokens import open_token_file
from hspmd.data.windows import TokenWindows
from hspmd.plan.strategy import parse_strategy
from hspmd.train.api import revise, train_config
from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.packing import packed_steps
from hspmd.train.trainer import train

EOD = 1


def write_corpus(path: Path, *, tokens: int, vocab: int, seed: int = 0) -> None:
    """Random ids in 2..vocab-1, an ``EOD`` after each document (lengths: lognormal, median
    about 400 ids, long tail), written in chunks."""
    rng = np.random.default_rng(seed)
    with path.open("wb") as handle:
        left = tokens
        while left > 0:
            ids = rng.integers(2, vocab, min(left, 1 << 22), dtype=np.uint16)
            ends = np.cumsum(rng.lognormal(6.0, 1.0, len(ids) // 100 + 1).astype(np.int64) + 2)
            ids[ends[ends < len(ids)]] = EOD
            ids.tofile(handle)
            left -= len(ids)


def median_seconds(run: Callable[[int], object], steps: range) -> float:
    times = []
    for step in steps:
        start = time.perf_counter()
        run(step)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_seconds(config: TrainConfig) -> float:
    """The median step time of hspmd's run of ``config`` (the first step is warm-up)."""
    records = train(config, threads=1).records
    return statistics.median(r.seconds for r in records[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--vocab", type=int, default=4096, help="ids of the file and model")
    parser.add_argument("--tokens", type=int, default=20_000_000, help="ids in the file")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    parser.add_argument("--data-steps", type=int, default=200, help="steps the data rows time")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="hspmd-bench-data-"))
    path = folder / "train.bin"
    write_corpus(path, tokens=args.tokens, vocab=args.vocab)
    ids = open_token_file(path).ids
    base = train_config(
        model=args.model, model_kwargs=(("vocab_size", args.vocab),), data=str(path),
        global_batch=args.global_batch, seq_len=args.seq_len, steps=args.steps,
        adam=AdamConfig(lr=1e-4), device=args.device, data_cache=str(folder / "cache"),
    )  # fmt: skip
    n = base.model_config().num_layers
    fixed = revise(base, strategy=f"1x{args.global_batch}: R0:L0-{n - 1}")
    packed = revise(
        fixed, strategy=f"{args.global_batch}x1: R0:L0-{n - 1}", eod_id=EOD,
        step_tokens=args.global_batch * args.seq_len * 3 // 4,  # slack for the packing
    )  # fmt: skip
    data_steps = range(1, args.data_steps + 1)
    windows = TokenWindows(ids, args.global_batch, args.seq_len, seed=0)
    fixed_data = median_seconds(windows.batch, data_steps)
    steps = iter(packed_steps(revise(packed, steps=args.data_steps + 1),
                              parse_strategy(packed.strategy or "")))  # fmt: skip
    next(steps)  # the first step splits the file at its end ids (cached for the run)
    packed_data = median_seconds(lambda _: next(steps), data_steps)
    packed_tokens = statistics.mean(
        s.tokens for s in islice(packed_steps(packed, parse_strategy(packed.strategy or "")), 4)
    )
    fixed_step, packed_step = step_seconds(fixed), step_seconds(packed)
    tokens = args.global_batch * args.seq_len
    rows = [
        ("fixed", tokens, fixed_data, fixed_step),
        ("packed", packed_tokens, packed_data, packed_step),
    ]
    table = Table(title=f"{args.model} (vocabulary {args.vocab}), {args.global_batch} x "
                  f"{args.seq_len} tokens a step, {args.tokens:,}-id memory-mapped file, "
                  f"step on {args.device}")  # fmt: skip
    for column in ("path", "data ms", "data tokens/s", "step ms", "step tokens/s", "ratio"):
        table.add_column(column, justify="right")
    for name, count, data_s, step_s in rows:
        table.add_row(name, f"{data_s * 1e3:.3f}", f"{count / data_s:,.0f}",
                      f"{step_s * 1e3:.1f}", f"{count / step_s:,.0f}", f"{data_s / step_s:.4f}")  # fmt: skip
    Console().print(table)
    print(json.dumps({
        "benchmark": "data", "model": args.model, "vocab": args.vocab, "tokens": args.tokens,
        "global_batch": args.global_batch, "seq_len": args.seq_len, "device": args.device,
        "fixed_data_tokens_per_s": tokens / fixed_data, "fixed_step_tokens_per_s": tokens / fixed_step,
        "fixed_ratio": fixed_data / fixed_step,
        "packed_data_tokens_per_s": packed_tokens / packed_data,
        "packed_step_tokens_per_s": packed_tokens / packed_step,
        "packed_ratio": packed_data / packed_step, "goal": 0.02,
    }))  # fmt: skip
    for file in sorted(folder.rglob("*"), reverse=True):
        file.unlink() if file.is_file() else file.rmdir()
    folder.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
