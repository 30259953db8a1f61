"""`hspmd demo`: a short heterogeneous run on local processes (CPU with gloo, unless torch
sees a GPU per rank: ``--device``), checked against the single-device reference (on the
ranks' device).

It prints the plan (the strategy and what each rank does), the progress of every step,
then the comparison with the reference: the same model, data and global batch trained
on one process with plain PyTorch. On CPU everything runs on this machine (gloo, one
thread per rank) in well under a minute.

    hspmd demo                       # the default heterogeneous strategy
    hspmd demo --strategy "..." --steps 5
"""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console
from rich.table import Table

from hspmd.cli.flags import HelpFormatter
from hspmd.cli.train import add_config_arguments, config_from_args, progress
from hspmd.train.compare import compare
from hspmd.train.config import TrainConfig
from hspmd.train.describe import COLUMNS, describe_ranks
from hspmd.train.device import run_device
from hspmd.train.reference import run_reference
from hspmd.train.trainer import check_config, num_processes, train

# Two pipelines that differ in everything: pipeline 0 runs 3 micro-batches of 1 sequence
# through a tensor-parallel stage of 2 ranks (layers 0-1) and a single-rank stage (layers
# 2-3), joined by a batched send/receive; pipeline 1 runs 1 micro-batch of 2 sequences
# through the whole model on one rank. Gradients meet in a split-all-reduce.
DEFAULT_STRATEGY = "3x1: R0-1:L0-1 R2:L2-3; 1x2: R3:L0-3"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="a short heterogeneous training run on local processes, checked against the reference",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_config_arguments(parser, strategy=DEFAULT_STRATEGY)
    parser.set_defaults(seq_len=32, steps=4, lr=1e-3, data_max_bytes=1 << 20)
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    parser.set_defaults(func=run)


def show_plan(config: TrainConfig, console: Console) -> None:
    strategy = check_config(config)
    batch = config.batch
    console.print(f"[bold]strategy[/] {strategy}  ({strategy.num_ranks} ranks, "
                  f"global batch {batch.global_batch} x {batch.seq_len} tokens)")  # fmt: skip
    table = Table(*COLUMNS[:-1])
    rows = describe_ranks(config)
    for row in rows:
        table.add_row(*row[:-1])
    console.print(table)
    for row in rows:
        console.print(f"  rank {row[0]} schedule: {row[-1]}")


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    console = Console()
    show_plan(config, console)
    with progress(config, title="hspmd", as_json=args.json) as on_step:
        result = train(config, on_step=on_step)
    # the reference on the ranks' device (CPU unless there is a GPU per rank)
    device = run_device(config, num_ranks=num_processes(config))
    with progress(config, title="reference", as_json=args.json) as on_step:
        reference = run_reference(
            dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, device=device)),
            on_step=on_step,
        )
    report = compare(result, reference, config=config)
    console.print(str(report))
    return 0 if report.ok else 1
