"""`hspmd explain`: what every rank would run under a strategy, without running anything.

    hspmd explain --model llama-32b --strategy "33x1: R0-3:L0-14 ...; 31x1: ..." [--rank 5]
    hspmd explain --model my_model.py:make_model --config '{"num_layers": 4}' \\
        --strategy "4x1: R0-1:L0-1 R2-3:L2-3"
    hspmd explain --model my_model.py:make_model --plan plan.json


prints the pipelines found from the plan's communication, each rank's executable graph
summary (ops, held parameters, communication by kind) and its schedule; ``--json`` prints
one JSON object instead. ``--model`` is a preset or any nn.Module's factory (docs/models.md):
a preset's sites come by formula, a user model's by deducing each pipeline's graph on the
meta device. ``--plan`` reads the strategy, options, sequence length and splits from an
annotation plan (docs/plan-schema.md) instead of ``--strategy`` and the option flags. ``--cluster NAME|FILE`` adds each rank's GPU kind (checking that the
cluster has the strategy's ranks); ``--picture FILE.png|.svg`` also draws the plan: ranks x
layers, one colour per pipeline, TP groups as blocks, the gradient sync per layer range.
"""

from __future__ import annotations

import argparse
import json
import time

from hspmd.cli.flags import STRATEGY_FLAGS, HelpFormatter, add_flags, shares_of, zero_of
from hspmd.cli.model_input import add_model_arguments, read_run, seq_len_of
from hspmd.errors import StrategyError
from hspmd.models.config import PRESETS
from hspmd.plan.strategy import StrategyOptions, check_strategy
from hspmd.specialize.explain import explain, render, runs_text
from hspmd.viz.common import check_picture_path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="show pipelines, per-rank graphs, communication and schedules of a strategy",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_model_arguments(parser, presets=sorted(PRESETS), default="llama-tiny", plan=True)
    add_flags(parser, ["--dataset"])
    add_flags(parser, ["--strategy"])
    parser.add_argument("--rank", type=int, default=None, help="show only this rank")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's max")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_flags(parser, STRATEGY_FLAGS)
    parser.add_argument("--cluster", default=None, help="cluster file or shipped name: GPU kinds")
    parser.add_argument("--picture", default=None, metavar="FILE", help="also draw FILE.png|.svg")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.picture:
        check_picture_path(args.picture)
    run_of = read_run(
        args,
        StrategyOptions(
            zero=zero_of(args),
            zero_shares=shares_of(args),
            sequence_parallel=args.sequence_parallel,
            recompute=args.recompute,
            schedule=args.schedule,
            dtype=args.dtype,
        ),
    )
    config, options = run_of.model, run_of.options
    seq_len = seq_len_of(config, run_of.seq_len)
    strategy = run_of.strategy
    check_strategy(strategy, config, options=options, seq_len=seq_len)
    kinds = _gpu_kinds(args.cluster, strategy.ranks) if args.cluster else None
    if args.rank is not None and args.rank not in strategy.ranks:
        raise StrategyError(
            f"--rank {args.rank} is not in the strategy (ranks {runs_text(sorted(strategy.ranks))})"
        )
    ranks = None if args.rank is None else [args.rank]
    explanation = explain(config, strategy, options, seq_len=seq_len, ranks=ranks)
    if args.json:
        data = explanation.to_json()
        if kinds:
            for r in data["ranks"]:
                r["gpu_kind"] = kinds[r["rank"]]
        print(json.dumps(data))
    else:
        print(f"model: {config.name}")
        print(render(explanation, rank=args.rank, kinds=kinds))
        print(f"\n(explained in {time.perf_counter() - start:.2f} s, nothing allocated)")
    if args.picture:
        from hspmd.viz.plan import draw_plan

        title = f"{config.name}, {strategy}"
        draw_plan(explanation, args.picture, kinds=kinds, title=title)
        if not args.json:
            print(f"picture: {args.picture}")
    return 0


def _gpu_kinds(cluster_name: str, ranks: tuple[int, ...]) -> dict[int, str]:
    """Each rank's GPU kind in the cluster (ClusterError when it lacks a rank)."""
    from hspmd.cost.cluster import load_cluster

    cluster = load_cluster(cluster_name)
    cluster.check_ranks(ranks, what="the strategy")
    return {r: cluster.kind_of(r).name for r in ranks}
