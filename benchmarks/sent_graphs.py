"""A training launch whose workers receive the launcher's captured graph, against one whose
workers capture the model themselves (``hspmd.graph.portable``, docs/runtime.md).

One config (``--model``, ``--strategy``, 2 steps) is checked and captured in this process,
then launched ``--rounds`` times each way, alternating which goes first, on the same warm
forkserver: "sent" passes the graphs ``train_many`` sends (``sent_graphs``), "captured"
passes none, so every rank runs ``torch.export`` itself. A row is the median wall time of
a launch; the ratio is captured / sent.

    PYTHONPATH=src .venv/bin/python benchmarks/sent_graphs.py [--rounds 3]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

from rich.console import Console
from rich.table import Table

from hspmd.runtime.launch import launch, preload
from hspmd.train.api import train_config
from hspmd.train.config import TrainConfig
from hspmd.train.trainer import _graphs, _rank_work, num_processes


def _launch(config: TrainConfig, sent: bool) -> float:
    events = mp.get_context("forkserver").SimpleQueue()
    graphs = _graphs([config]) if sent else ()
    start = time.perf_counter()
    launch(_rank_work, num_processes(config), args=([config], events, False, graphs))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--strategy", default="2x1: R0:L0 R1:L1-3; 1x2: R2-3:L0-3")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    preload("torch._dynamo", "hspmd.train.trainer", "torch.export._trace")
    config = train_config(
        model=args.model, strategy=args.strategy, global_batch=args.global_batch, steps=2
    )
    _launch(config, True)  # starts the forkserver; captures in this process
    times: dict[str, list[float]] = {"sent": [], "captured": []}
    for round_ in range(args.rounds):
        order = ("sent", "captured") if round_ % 2 == 0 else ("captured", "sent")
        for side in order:
            times[side].append(_launch(config, side == "sent"))
    median = {side: statistics.median(values) for side, values in times.items()}
    table = Table(title=f"{args.model}, {args.strategy}: one launch of 2 steps (median)")
    for column in ("workers", "wall s", "launches"):
        table.add_column(column)
    for side, values in times.items():
        table.add_row(side, f"{median[side]:.2f}", " ".join(f"{v:.2f}" for v in values))
    Console().print(table)
    ratio = median["captured"] / median["sent"]
    print(json.dumps({"benchmark": "sent_graphs", "model": args.model, "strategy": args.strategy,
                      "sent_s": round(median["sent"], 3),
                      "captured_s": round(median["captured"], 3),
                      "captured_over_sent": round(ratio, 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
