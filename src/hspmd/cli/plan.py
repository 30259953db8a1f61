"""`hspmd plan`: choose a strategy for a model on a cluster.

    hspmd plan --model llama-70b --cluster hetu-h800-h20 --global-batch 64 --seq-len 4096
    hspmd plan ... --json                       # one JSON object (strategy, step_time_s, ...)
    hspmd plan ... --out strategy.json          # the same object, written to a file
    hspmd train --plan strategy.json ...        # trains it (its options, length, batch)
    hspmd plan ... --alive 0-14,16-39 --current "33x1: ...; 31x1: ..."   # elastic re-plan

Searches pipeline configurations (TP degree per GPU kind, pipelines, stage order, which
ranks stay idle, micro-batch size), solves the layers-per-stage and micro-batches-per-
pipeline ILPs for the best of them, simulates the survivors (as `hspmd simulate` does) and
prints the fastest plan that fits every rank's memory, beside the best homogeneous
(Megatron-style DP x TP x PP, even layers) plan of the same ranks. docs/planner.md has the
formulation.

With ``--alive`` or ``--current`` it re-plans for elastic training instead
(docs/elastic-planning.md): only the alive ranks, at least ``--min-replicas`` pipelines,
ZeRO-1 off, warm-started from the current strategy, and prints what the switch moves.

The ZeRO stage is chosen per candidate plan (``--zero auto``): the simulator prices each
stage, and more sharding is taken only where memory binds (docs/zero.md, "The planner's
choice"); where a layer's replicas sit on devices of unequal memory, memory-proportional
``zero_shares`` too. The strategy file's ``options`` carry both to ``hspmd train --plan``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hspmd.cli.flags import HelpFormatter
from hspmd.cli.model_input import model_kwargs
from hspmd.cli.paths import check_out_folder, write_out
from hspmd.cli.simulate import GIB, add_common, setup
from hspmd.cli.strategy_arg import strategy_argument
from hspmd.cost.lines import CostModel
from hspmd.models.spec import ModelSpec
from hspmd.plan.choice import choice_fields
from hspmd.plan.identity import ModelIdentity
from hspmd.plan.strategy import format_ranks, parse_ranks, parse_strategy
from hspmd.planner.elastic import replan
from hspmd.planner.search import Plan, PlanError, plan


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="choose a heterogeneous strategy (and the best homogeneous one) for a cluster",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_common(parser)
    parser.add_argument("--global-batch", type=int, default=None, help="samples per step")
    parser.add_argument(
        "--zero1", default="auto", choices=("auto", "on", "off"),
        help="ZeRO-1 (auto: on wherever there are replicas; off: no ZeRO stage at all)",
    )  # fmt: skip
    parser.add_argument(
        "--zero", default="auto", choices=("auto", "0", "1", "2", "3"),
        help="the ZeRO stage (auto: chosen per plan with its shares, docs/zero.md)",
    )  # fmt: skip
    parser.add_argument(
        "--even-shares", action="store_true",
        help="never give replicas uneven ZeRO shares (default: memory-proportional where "
        "their devices differ)",
    )  # fmt: skip
    parser.add_argument(
        "--time-limit", type=float, default=None, help="seconds per ILP solve (default: none)"
    )
    parser.add_argument(
        "--no-homogeneous", action="store_true", help="skip the homogeneous baseline"
    )
    parser.add_argument(
        "--out", default=None,
        help="also write the JSON object to this file: a strategy file that hspmd train, "
        "explain and simulate take as --plan",
    )  # fmt: skip
    elastic = parser.add_argument_group("elastic re-planning (docs/elastic-planning.md)")
    elastic.add_argument(
        "--alive", default=None, help="cluster ranks usable now, e.g. 0-14,16-39 (default: all)"
    )
    elastic.add_argument(
        "--current", default=None, type=strategy_argument,
        help="the strategy running now (the warm start), or @FILE holding it",
    )  # fmt: skip
    elastic.add_argument(
        "--min-replicas", type=int, default=2, help="pipelines that hold every layer"
    )
    from hspmd.cli.plan_lengths import add_arguments

    add_arguments(parser)
    for action in parser._actions:  # optional with --data (the length planner's defaults)
        if action.dest in ("model", "cluster"):
            action.required = False
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.out:
        check_out_folder(args.out, "--out")  # before the search
    if args.data is not None:
        from hspmd.cli.plan_lengths import run as run_lengths

        return run_lengths(args)
    missing = [f"--{n}" for n in ("model", "cluster", "global_batch") if getattr(args, n) is None]
    if missing:
        raise PlanError(f"hspmd plan needs {' and '.join(missing).replace('_', '-')} (or --data)")
    config, cost, seq_len = setup(args)
    if args.global_batch < 1:
        raise PlanError(f"--global-batch {args.global_batch}: give at least 1")
    if args.time_limit is not None and args.time_limit <= 0:
        raise PlanError(f"--time-limit {args.time_limit}: give a positive number of seconds")
    if args.alive is not None or args.current is not None:
        return _run_elastic(args, config, cost, seq_len)
    chosen = plan(
        config, cost, global_batch=args.global_batch, seq_len=seq_len, zero1=args.zero1,
        dtype=args.dtype, time_limit=args.time_limit, homogeneous=not args.no_homogeneous,
        zero=None if args.zero == "auto" else int(args.zero), uneven_shares=not args.even_shares,
    )  # fmt: skip
    data = strategy_file(args, chosen.to_json(cost), chosen, model=config, seq_len=seq_len)
    if args.out:
        write_out(args.out, json.dumps(data, indent=1) + "\n")
    if args.json:
        print(json.dumps(data))
    else:
        print(plan_text(chosen, cost, model=config.name, seq_len=seq_len))
    return 0


def strategy_file(
    args: argparse.Namespace, data: dict[str, Any], chosen: Plan | Any, *, model: ModelSpec,
    seq_len: int,
) -> dict[str, Any]:  # fmt: skip
    """The planner's JSON as a strategy file (``hspmd.plan.choice``): its format, the
    model's identity, the length and batch planned for and the options ``hspmd train
    --plan`` takes, then the planner's own fields."""
    identity = ModelIdentity.of(model, source=args.model, kwargs=dict(model_kwargs(args.config)))
    head = choice_fields(
        strategy=str(chosen.strategy), options=chosen.options, model=identity, seq_len=seq_len,
        global_batch=chosen.strategy.global_batch,
    )  # fmt: skip
    return head | {k: v for k, v in data.items() if k not in head}


def _run_elastic(
    args: argparse.Namespace, config: Any, cost: CostModel, seq_len: int
) -> int:  # fmt: skip
    current = parse_strategy(args.current) if args.current else None
    alive = parse_ranks(args.alive) if args.alive else range(cost.num_ranks)
    chosen = replan(
        config, cost, alive=alive, current=current, global_batch=args.global_batch,
        seq_len=seq_len, dtype=args.dtype, min_replicas=args.min_replicas,
        time_limit=args.time_limit,
    )  # fmt: skip
    data = strategy_file(args, chosen.to_json(cost), chosen, model=config, seq_len=seq_len)
    if args.out:
        write_out(args.out, json.dumps(data, indent=1) + "\n")
    if args.json:
        print(json.dumps(data))
        return 0
    moved = (
        "no current strategy" if current is None
        else f"layers {chosen.lost_layers} lost every holder: restore them from a checkpoint"
        if chosen.switch is None
        else f"{chosen.switch.moved_bytes / 1e9:.3g} GB of masters and Adam states, predicted "
        f"{chosen.switch.seconds:.3g} s (fused BSR)"
    )  # fmt: skip
    idle = f"R{format_ranks(chosen.unused_ranks)}" if chosen.unused_ranks else "none"
    print("\n".join([
        f"{config.name} on {cost.cluster.name}: {len(chosen.alive)} alive ranks "
        f"(R{format_ranks(chosen.alive)}), global batch {args.global_batch}, seq_len {seq_len}",
        f"strategy: {chosen.strategy}",
        f"options: {_flags(chosen)}  ({len(chosen.strategy.pipelines)} replicas)",
        f"predicted step time: {chosen.step_time_s:.4g} s (fastest found "
        f"{chosen.fastest_step_time_s:.4g} s)   idle alive ranks: {idle}",
        f"switch from the current strategy: {moved}",
        f"planned in {chosen.plan_seconds:.2f} s (winner: {chosen.source})",
    ]))  # fmt: skip
    return 0


def _flags(p: Plan | Any) -> str:
    o = p.options
    flags = [f"--zero {o.zero}"] if o.zero and len(p.strategy.pipelines) > 1 else []
    if o.zero_shares and len(p.strategy.pipelines) > 1:
        flags.append("--zero-shares " + ",".join(f"{w:g}" for w in o.zero_shares))
    flags += ["--recompute"] if o.recompute else []
    if o.recompute and o.recompute_layers:
        flags.append(f"--recompute-layers {o.recompute_layers}")
    if o.sequence_parallel:
        flags.append("--sequence-parallel")
    return " ".join(flags) or "(none)"


def plan_text(p: Plan, cost: CostModel, *, model: str, seq_len: int) -> str:
    """The chosen plan, its options and memory per kind, and the homogeneous baseline."""
    pred = p.prediction
    mbs = p.strategy.pipelines[0].micro_batch_size
    caps = {k: d.memory_bytes for k, d in cost.devices.items()}
    memory = ", ".join(
        f"{k} {v / GIB:.1f}/{caps[k] / GIB:.1f} GiB" for k, v in pred.peak_by_kind(cost).items()
    )
    lines = [
        f"{model} on {cost.cluster.name} ({cost.num_ranks} ranks), global batch "
        f"{p.strategy.global_batch}, seq_len {seq_len}, {p.options.dtype}",
        f"strategy: {p.strategy}",
        f"options: {_flags(p)}  micro-batch size {mbs}, schedule {p.options.schedule}",
        f"predicted step time: {p.step_time_s:.4g} s   peak memory: {memory}",
    ]
    if p.unused_ranks:
        from hspmd.plan.strategy import format_ranks

        lines.append(
            f"idle ranks: R{format_ranks(p.unused_ranks)} (the plan is faster without them)"
        )
    if p.homogeneous is not None:
        h = p.homogeneous
        lines += [
            f"best homogeneous: {h.strategy}",
            f"  options: {_flags(h)}  predicted step time: {h.step_time_s:.4g} s "
            f"({h.step_time_s / p.step_time_s:.2f}x the plan's)",
        ]
    else:
        lines.append("best homogeneous: none fits (or skipped)")
    lines.append(f"planned in {p.plan_seconds:.2f} s ({p.candidates} configurations costed)")
    return "\n".join(lines)
