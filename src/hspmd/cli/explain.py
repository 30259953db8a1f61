"""`hspmd explain`: what every rank would run under a strategy, without running anything.

    hspmd explain --model llama-32b --strategy "33x1: R0-3:L0-14 ...; 31x1: ..." [--rank 5]

prints the pipelines found from the plan's communication, each rank's executable graph
summary (ops, held parameters, communication by kind) and its schedule; ``--json`` prints
one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from hspmd.models.config import PRESETS, get_config
from hspmd.plan.strategy import StrategyOptions, check_strategy, parse_strategy
from hspmd.specialize.explain import explain, render


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="show pipelines, per-rank graphs, communication and schedules of a strategy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="llama-tiny", choices=sorted(PRESETS))
    parser.add_argument("--strategy", required=True, help='e.g. "4x1: R0-1:L0-1 R2-3:L2-3"')
    parser.add_argument("--rank", type=int, default=None, help="show only this rank")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's max")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--zero1", action="store_true")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    config = get_config(args.model)
    seq_len = args.seq_len or config.max_seq_len
    options = StrategyOptions(
        zero1=args.zero1,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        schedule=args.schedule,
        dtype=args.dtype,
    )
    strategy = parse_strategy(args.strategy)
    check_strategy(strategy, config, options=options, seq_len=seq_len)
    explanation = explain(config, strategy, options, seq_len=seq_len)
    if args.json:
        data = explanation.to_json()
        if args.rank is not None:
            data["ranks"] = [r for r in data["ranks"] if r["rank"] == args.rank]
        print(json.dumps(data))
    else:
        print(f"model: {args.model}")
        print(render(explanation, rank=args.rank))
        print(f"\n(explained in {time.perf_counter() - start:.2f} s, nothing allocated)")
    return 0
