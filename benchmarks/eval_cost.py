"""What a held-out evaluation costs against a training step, and that it equals the
reference's.

For each strategy, one launch of local gloo processes (one thread per rank) trains
llama-tiny on 8 x 128 tokens a step with an evaluation after every second step (K global
batches of the same size from the last 5% of the corpus, forward only: the strategy's
forward-only schedule, no backward, no optimizer). The figure is one evaluated batch's
time (an evaluation's seconds over K, median over the run's evaluations) over the median
step time (step 1 left out): a forward without the backward's two matmuls per matmul and
without gradient sync or AdamW, about a third of a step where compute dominates. The
evaluations are compared with the single-device reference's (the plain module in eval
mode under no_grad): the largest relative difference of their losses.

    .venv/bin/python benchmarks/eval_cost.py            # 3 strategies, 8 steps, K = 4
    .venv/bin/python benchmarks/eval_cost.py --quick    # 1 strategy, 4 steps

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics

from rich.console import Console
from rich.table import Table

from hspmd.train.api import revise, train_config
from hspmd.train.config import AdamConfig, EvalConfig
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import train_many

STRATEGIES = {
    "2-rank DP": "4x1: R0:L0-3; 4x1: R1:L0-3",
    "PP4": "8x1: R0:L0 R1:L1 R2:L2 R3:L3",
    "TP2+PP2 | TP1": "2x2: R0-1:L0-1 R2:L2-3; 2x2: R3:L0-3",
}


def _figures(result: TrainResult, reference: TrainResult, batches: int) -> dict[str, float]:
    step = statistics.median(r.seconds for r in result.records[1:])
    per_batch = statistics.median(e.seconds for e in result.evaluations) / batches
    rel = max(abs(a.loss - b.loss) / abs(b.loss)
              for a, b in zip(result.evaluations, reference.evaluations, strict=True))  # fmt: skip
    return {"step_s": step, "eval_batch_s": per_batch, "ratio": per_batch / step, "eval_rel": rel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one strategy, 4 steps")
    parser.add_argument("--batches", type=int, default=4, help="global batches an evaluation")
    args = parser.parse_args()
    names = list(STRATEGIES)[:1] if args.quick else list(STRATEGIES)
    steps = 4 if args.quick else 8
    base = train_config(global_batch=8, seq_len=128, steps=steps, adam=AdamConfig(lr=1e-3),
                       data_max_bytes=1 << 21,
                       evaluation=EvalConfig(every=2, batches=args.batches, split=0.05))  # fmt: skip
    configs = [revise(base, strategy=STRATEGIES[n]) for n in names]
    results = train_many(configs, threads=1, timeout_s=1800)
    reference = run_reference(revise(base, device="cpu"))
    rows = {n: _figures(r, reference, args.batches) for n, r in zip(names, results, strict=True)}
    table = Table("strategy", "step ms", "eval ms / batch", "eval batch / step", "eval vs ref")
    for name, f in rows.items():
        table.add_row(name, f"{f['step_s'] * 1e3:.0f}", f"{f['eval_batch_s'] * 1e3:.0f}",
                      f"{f['ratio']:.2f}", f"{f['eval_rel']:.1e}")  # fmt: skip
    Console().print(table)
    print(json.dumps({"batches": args.batches, "steps": steps, "strategies": rows}))


if __name__ == "__main__":
    main()
