"""Counter-based dropout (hspmd.randomness) against torch's, on this machine.

Two measurements, side by side in one run, methods interleaved in each round (median of
``--repeats``):

    mask     forward of one dropout on a (B, T, H) fp32 tensor: ``F.dropout`` vs
             ``hspmd.randomness.dropout`` (the keep bits hashed from each element's place)
    resid    forward + backward of a nanoGPT-style model (tests/models/data/nanogpt_style.py,
             dropout 0.1 on embeddings, residuals and MLP; none on the attention weights)
             eager with torch's dropout, vs under ``positional_dropout`` (what the
             reference runs and every rank's executable draws)
    all      the same with dropout 0.1 on the attention weights too: torch's fused SDPA
             vs SDPA's math form with the weights dropped by position

The final JSON line has the ratios counter / torch.

    python benchmarks/dropout.py                    # ~1 min; one thread: on a shared machine
                                                    # two threads wait on each other (8x here)
    python benchmarks/dropout.py --batch 8 --seq-len 256 --repeats 7 --threads 4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from hspmd.randomness import dropout, dropout_key, positional_dropout

MODEL_FILE = Path(__file__).parents[1] / "tests" / "models" / "data" / "nanogpt_style.py"


def _timed(fn: Callable[[], object]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def _nanogpt(seq_len: int) -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("nanogpt_style", MODEL_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.make(dropout=0.1, n_layer=4, n_embd=256, n_head=8, block_size=seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b, t = args.batch, args.seq_len
    x = torch.randn(b, t, args.hidden)
    key = dropout_key(1, range(b))
    tokens = torch.randint(0, 256, (b, t))
    targets = torch.randint(0, 256, (b, t))
    models = {"resid": _nanogpt(t), "all": _nanogpt(t)}
    for block in models["resid"].transformer.h:
        block.attn.dropout = 0.0  # the attention's dropout_p

    def step(model: torch.nn.Module, counter: bool) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            if counter:
                with positional_dropout(seed=0, step=1, rows=range(b)):
                    model(tokens, targets)[1].backward()
            else:
                model(tokens, targets)[1].backward()

        return run

    methods: dict[str, Callable[[], object]] = {
        "mask torch": lambda: F.dropout(x, 0.1, True),
        "mask counter": lambda: dropout(x, key, p=0.1, seed=0, op=0),
    }
    for name, model in models.items():
        methods[f"{name} torch"] = step(model, False)
        methods[f"{name} counter"] = step(model, True)
    for fn in methods.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            times[name].append(_timed(fn))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"{name:14s} {value * 1e3:9.2f} ms")
    elements = b * t * args.hidden
    print(json.dumps({
        "shape": [b, t, args.hidden], "threads": args.threads,
        "mask_ns_per_element": {k.split()[1]: medians[k] / elements * 1e9
                                for k in ("mask torch", "mask counter")},
        **{f"{name}_ratio": medians[f"{name} counter"] / medians[f"{name} torch"]
           for name in ("mask", "resid", "all")},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
