"""Metadata at scale: explain, simulate, switch-cost and one rank's executable, by rank count.

llama-70b (80 layers), sequence 4096, on H20 nodes of 8 (``h20x32``'s kind, as many nodes as
the run needs). For each size, a strategy of P pipelines of S stages of TP T, and a switch
target with twice the pipelines and half the stages (the same ranks):

    ranks    strategy            switch target
    48       3 x 4 stages x TP4  6 x 2 stages x TP4
    512      8 x 8 stages x TP8  16 x 4 stages x TP8
    4096     64 x 8 stages x TP8 128 x 4 stages x TP8

Measured, each size in its own process (so ``peak_MB``, the process's maximum RSS, is that
size's alone; torch's import is in it):

- ``explain``: ``hspmd.specialize.explain.explain`` for rank 0 (what ``hspmd explain --rank 0``
  computes: the per-rank graph, communication and schedule summary);
- ``simulate``: ``hspmd.planner.predict.predict``, one simulated step of every rank;
- ``switch``: ``hspmd.switch.cost.switch_cost`` of the fused BSR, strategy -> target;
- ``executable``: ``build_executable`` of rank 0 on the meta device (nothing allocated;
  deduction and the per-rank graph, as a worker builds it before binding a world).

Goals (issue 12): each command under 30 s at 4096 ranks, one rank's executable under 2 s,
peak memory under 4 GiB. Run: ``python benchmarks/metadata_scale.py [--sizes 48 512 4096]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

SIZES = {48: (3, 4, 4), 512: (8, 8, 8), 4096: (64, 8, 8)}
MODEL = "llama-70b"
SEQ_LEN = 4096


def strategy_text(pipelines: int, stages: int, tp: int, layers: int) -> str:
    """``pipelines`` pipelines of ``stages`` even stages of ``tp`` ranks, 4 micro-batches of 1."""
    per = layers // stages
    out, rank = [], 0
    for _ in range(pipelines):
        parts = []
        for s in range(stages):
            last = layers - 1 if s == stages - 1 else (s + 1) * per - 1
            parts.append(f"R{rank}-{rank + tp - 1}:L{s * per}-{last}")
            rank += tp
        out.append("4x1: " + " ".join(parts))
    return "; ".join(out)


def cluster_json(num_ranks: int) -> dict[str, Any]:
    return {
        "format": "hspmd.cluster/1",
        "name": f"h20x{num_ranks}",
        "description": f"{num_ranks} H20 in nodes of 8 (benchmark)",
        "gpu_kinds": {
            "H20": {
                "memory_mb": 97871,
                "bf16_tflops": 148,
                "achieved_tflops": 74,
                "hbm_GBps": 4000,
                "intra_link": {"name": "nvlink", "GBps": 900},
            }  # fmt: skip
        },
        "inter_link": {"name": "ib", "GBps": 50},
        "nodes": [{"kind": "H20", "count": num_ranks // 8, "gpus_per_node": 8}],
    }


def measure(num_ranks: int) -> dict[str, Any]:
    """One size, in this process."""
    import torch

    from hspmd.models.config import get_config
    from hspmd.plan.strategy import StrategyOptions, parse_strategy
    from hspmd.planner.cost import CostModel
    from hspmd.planner.predict import predict
    from hspmd.specialize.executable import build_executable
    from hspmd.specialize.explain import explain
    from hspmd.switch.cluster import cluster_from_json
    from hspmd.switch.cost import switch_cost

    config = get_config(MODEL)
    p, s, t = SIZES[num_ranks]
    text = strategy_text(p, s, t, config.num_layers)
    target = strategy_text(2 * p, s // 2, t, config.num_layers)
    strategy, options = parse_strategy(text), StrategyOptions(dtype="bf16")
    cluster = cluster_from_json(cluster_json(num_ranks))
    row: dict[str, Any] = {"ranks": num_ranks, "strategy": f"{p} x {s} stages x TP{t}"}

    start = time.perf_counter()
    explain(config, strategy, options, seq_len=SEQ_LEN, ranks=[0])
    row["explain_s"] = time.perf_counter() - start

    start = time.perf_counter()
    cost = CostModel.of(cluster, dtype="bf16")
    prediction = predict(strategy, config, cost, seq_len=SEQ_LEN, options=options)
    row["simulate_s"] = time.perf_counter() - start
    row["predicted_step_s"] = prediction.step_time_s

    start = time.perf_counter()
    estimate = switch_cost(model=MODEL, source=text, target=target, cluster=cluster, algo="fused")
    row["switch_s"] = time.perf_counter() - start
    row["switch_predicted_s"] = estimate.estimate.time

    start = time.perf_counter()
    with torch.device("meta"):
        # fp32: the executable builder takes bf16 through TrainConfig's dtype, not here
        build_executable(config, strategy, StrategyOptions(), 0, seq_len=SEQ_LEN, seed=0)
    row["executable_s"] = time.perf_counter() - start
    row["peak_MB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=sorted(SIZES), choices=sorted(SIZES)
    )
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one)))
        return
    rows = []
    for size in args.sizes:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(size)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cols = ("ranks", "strategy", "explain_s", "simulate_s", "switch_s", "executable_s", "peak_MB")
    print(" | ".join(f"{c:>22}" if c == "strategy" else f"{c:>12}" for c in cols))
    for row in rows:
        cells = []
        for c in cols:
            v = row[c]
            cells.append(
                f"{v:>22}"
                if c == "strategy"
                else f"{v:>12.2f}"
                if isinstance(v, float)
                else f"{v:>12}"
            )
        print(" | ".join(cells))
    largest = rows[-1]
    summary = {
        "benchmark": "metadata_scale",
        "model": MODEL,
        "rows": rows,
        "largest_ranks": largest["ranks"],
        "largest_slowest_command_s": max(
            largest[k] for k in ("explain_s", "simulate_s", "switch_s", "executable_s")
        ),
        "largest_executable_s": largest["executable_s"],
        "largest_peak_MB": largest["peak_MB"],
        "goal_command_s": 30.0,
        "goal_executable_s": 2.0,
        "goal_peak_MB": 4096.0,
    }
    if len(rows) > 1:
        summary["explain_ratio_largest_to_smallest"] = largest["explain_s"] / rows[0]["explain_s"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
