"""Packed attention: block-diagonal causal attention over packed documents, four ways.

Rows of ``--seq-len`` tokens are packed with documents of the default corpus (the Python
standard library split into top-level blocks: long-tailed lengths, ``hspmd.data``; or
``--corpus short``: many short documents) by the trainer's own dispatch and packing. Each method runs forward + backward of one attention
call with llama-small's heads (q: 8 heads, k/v: 4, head_dim 32), side by side in one run:

    per-document   causal SDPA on each document's slice (hspmd.attention.causal_attention)
    masked SDPA    one SDPA with the (B, 1, T, T) block-diagonal causal mask
    flex           torch's flex_attention with a block mask (its backward has no CPU
                   kernel in torch 2.13: forward only there, marked)
    full window    causal SDPA over the whole row: attention across documents (Megatron's
                   default packing, not the same function: the cost of no masking)

The median of ``--repeats`` rounds (methods interleaved in each) is shown per method and
length; the final JSON line has
the ratios masked / per-document (the speed-up of the chosen method) and per-document /
full window (the price of masking).

    python benchmarks/packed_attention.py                   # T = 512 and 2048, ~2 min
    python benchmarks/packed_attention.py --corpus short     # many short documents per row
    python benchmarks/packed_attention.py --seq-len 1024 --rows 8 --repeats 5 --threads 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F

from hspmd.attention import causal_attention, masked_attention
from hspmd.data import document_steps
from hspmd.plan.dispatch import balanced
from hspmd.train.packing import pack

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32


def packed_segments(
    rows: int, length: int, seed: int, data: str | None
) -> tuple[torch.Tensor, list[int]]:
    """Document ids of ``rows`` packed rows of ``length`` (the trainer's packing)."""
    stream = document_steps(int(rows * length * 0.9), seed, max_len=length, path=data)
    step = next(islice(stream, 1))
    assignment = balanced(step.lengths, slots=[(1, rows)], max_len=length)
    mb = pack(step, assignment).micro_batches[0][0]
    segments = torch.full((rows, length), -1, dtype=torch.long)
    segments[:, : mb.segments.shape[1]] = mb.segments  # pad the row to the full length
    return segments, list(step.lengths)


def corpus_path(corpus: str, folder: str, seed: int) -> str | None:
    """None for the default corpus; a JSONL of short documents for ``short``; else a path."""
    if corpus == "stdlib":
        return None
    if corpus != "short":
        return corpus
    rng = random.Random(seed)
    text = "".join(Path(m.__file__ or "").read_text() for m in (random, json, argparse))
    path = Path(folder) / "short.jsonl"
    with path.open("w") as out:
        for _ in range(4000):
            n = min(1500, int(rng.paretovariate(1.5) * 30))
            start = rng.randrange(len(text) - n)
            out.write(json.dumps({"text": text[start : start + n]}) + "\n")
    return str(path)


def _flex(segments: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    rows, length = segments.shape

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return (segments[b, q] == segments[b, kv]) & (q >= kv)

    block = create_block_mask(mask_mod, rows, None, length, length, device=str(segments.device))

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
        assert isinstance(out, torch.Tensor)
        return out

    return run


def run_once(
    fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    *, backward: bool,
) -> float:  # fmt: skip
    """Seconds of one forward (+ backward)."""
    for t in (q, k, v):
        t.grad = None
    start = time.perf_counter()
    if backward:
        fn(q, k, v).sum().backward()
    else:
        with torch.no_grad():
            fn(q.detach(), k.detach(), v.detach())
    return time.perf_counter() - start


def bench(length: int, rows: int, repeats: int, seed: int, data: str | None) -> dict[str, object]:
    segments, lengths = packed_segments(rows, length, seed, data)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HEADS, length, HEAD_DIM, generator=g, requires_grad=True)
    k, v = (
        torch.randn(rows, KV_HEADS, length, HEAD_DIM, generator=g, requires_grad=True)
        for _ in range(2)
    )
    methods: dict[str, tuple[Callable[..., torch.Tensor], bool]] = {
        "per-document": (lambda q, k, v: causal_attention(q, k, v, segments, enable_gqa=True), True),
        "masked SDPA": (lambda q, k, v: masked_attention(q, k, v, segments, enable_gqa=True), True),
        "full window": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            True,
        ),
    }  # fmt: skip
    flex = _flex(segments)
    if flex is not None:
        methods["flex (forward only)"] = (flex, False)
        methods["per-document (forward only)"] = (methods["per-document"][0], False)
    out: dict[str, object] = {"seq_len": length, "rows": rows, "documents": len(lengths)}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for index in range(repeats + 1):  # methods interleaved, so load changes hit them alike
        for name, (fn, backward) in methods.items():
            took = run_once(fn, q, k, v, backward=backward)
            if index:  # the first round warms up
                times[name].append(took)
    out.update({name: statistics.median(t) for name, t in times.items()})
    # the two exact methods agree (a check, not a figure)
    want = masked_attention(q, k, v, segments, enable_gqa=True)
    got = causal_attention(q, k, v, segments, enable_gqa=True)
    out["max_abs_diff"] = float((want - got).detach().abs().max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, nargs="*", default=[512, 2048])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared CPUs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--corpus",
        default="stdlib",
        help="stdlib (the default corpus split into blocks), short (many short documents: "
        "seeded slices of the stdlib sources, lengths Pareto(1.5) x 30 bytes, at most 1500), "
        "or a text / JSONL path",
    )
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        data = corpus_path(args.corpus, folder, args.seed)
        results = [bench(n, args.rows, args.repeats, args.seed, data) for n in args.seq_len]
    names = [k for k in results[0] if k not in ("seq_len", "rows", "documents", "max_abs_diff")]
    print(f"{'method':<30}" + "".join(f"{'T=' + str(r['seq_len']):>14}" for r in results))
    for name in names:
        row = "".join(f"{float(r[name]) * 1e3:>11.1f} ms" for r in results)  # type: ignore[arg-type]
        print(f"{name:<30}{row}")
    print(f"{'documents in the rows':<30}" + "".join(f"{r['documents']:>14}" for r in results))
    print(f"{'max |masked - per-document|':<30}" + "".join(f"{r['max_abs_diff']:>14.1e}" for r in results))  # fmt: skip
    summary: dict[str, object] = {"benchmark": "packed_attention", "corpus": args.corpus,
                                  "rows": args.rows, "threads": torch.get_num_threads()}  # fmt: skip
    for r in results:
        t = r["seq_len"]
        per_doc = float(r["per-document"])  # type: ignore[arg-type]
        summary[f"masked_over_per_document_T{t}"] = round(float(r["masked SDPA"]) / per_doc, 3)  # type: ignore[arg-type]
        summary[f"per_document_over_full_window_T{t}"] = round(per_doc / float(r["full window"]), 3)  # type: ignore[arg-type]
        if "flex (forward only)" in r:
            fwd = float(r["per-document (forward only)"])  # type: ignore[arg-type]
            summary[f"flex_over_per_document_forward_T{t}"] = round(
                float(r["flex (forward only)"]) / fwd, 3
            )  # type: ignore[arg-type]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
