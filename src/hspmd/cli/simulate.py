"""`hspmd simulate`: predict one training step of a strategy on a cluster.

    hspmd simulate --model llama-32b --cluster hetu-h800-h20 --seq-len 4096 --zero1 \\
        --sequence-parallel --strategy "32x1: R16-23:L0-16 R24-31:L17-33 R0-7:L34-79; ..."
    hspmd simulate ... --json                  # one JSON object
    hspmd simulate ... --timeline step.png     # Gantt chart per rank (or .svg)
    hspmd simulate ... --trace step.json       # Chrome / Perfetto trace
    hspmd simulate --model my_model.py:make_model --config '{"num_layers": 8}' \\
        --cluster h20x32 --seq-len 1024 --strategy "8x2: R0-7:L0-3 R8-15:L4-7"
    hspmd simulate --model my_model.py:make_model --cluster h20x32 --plan plan.json

Runs the schedules the runtime would run (1F1B or GPipe per stage, sends, the gradient
sync, Adam) on the discrete-event simulator with the cluster's cost model
(hspmd.cost.lines: its profiles, achieved_tflops, or half of the bf16 peak) and prints
the step time, per stage its forward and backward time, busy / communication / idle time
and peak memory against the cap, and the critical path. Exit status 1 when a rank's peak
exceeds its memory (the line names the rank, the peak and the cap).

``--model`` is a preset or any nn.Module's factory (docs/models.md): a preset is costed by
formula, any other model from its graph measured on the meta device
(``hspmd.cost.captured``; docs/planner.md, "Any model"). ``--plan plan.json`` gives the
strategy, options and sequence length in place of ``--strategy`` and the option flags.
"""

from __future__ import annotations

import argparse
import json

from hspmd.cli.flags import STRATEGY_FLAGS, HelpFormatter, add_flags, shares_of, zero_of
from hspmd.cli.model_input import add_model_arguments, read_model, read_run, seq_len_of
from hspmd.cli.paths import check_out_folder
from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.config import PRESETS, LlamaConfig
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import StrategyOptions, check_strategy
from hspmd.planner.predict import Prediction, predict

GIB = 2**30


def add_common(parser: argparse.ArgumentParser, *, plan: bool = False) -> None:
    """Arguments `simulate` and `plan` share (``plan``: ``--plan``, simulate's)."""
    add_model_arguments(parser, presets=sorted(PRESETS), default=None, plan=plan)
    add_flags(parser, ["--dataset"])
    parser.add_argument("--cluster", required=True, help="cluster file or shipped name")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's max")
    parser.add_argument(
        "--dtype", default="bf16", choices=("bf16", "fp32"),
        help="compute dtype (fp32 for CPU runs)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="predict a strategy's step time, per-rank times and memory on a cluster",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_common(parser, plan=True)
    add_flags(parser, ["--strategy"])
    parser.add_argument(
        "--global-batch", type=int, default=None,
        help="samples per step (default: the strategy's sum of COUNT x SIZE)",
    )  # fmt: skip
    add_flags(parser, [f for f in STRATEGY_FLAGS if f != "--dtype"])  # its --dtype: bf16
    parser.add_argument("--timeline", default=None, help="write a Gantt chart (.png or .svg)")
    parser.add_argument("--trace", default=None, help="write a Chrome trace (.json)")
    parser.set_defaults(func=run)


def setup(
    args: argparse.Namespace, model: ModelSpec | None = None, seq_len: int | None = None
) -> tuple[ModelSpec, CostModel, int]:
    """The model (with its measured cost figures unless a Llama preset), the cluster's cost
    model and the sequence length (errors: one line)."""
    config = costed_model(model if model is not None else read_model(args))
    cost = CostModel.of(load_cluster(args.cluster), dtype=args.dtype)
    return config, cost, seq_len_of(config, seq_len if seq_len is not None else args.seq_len)


def costed_model(model: ModelSpec) -> ModelSpec:
    """A Llama preset as it is (its formulas); any other model with its cost figures
    measured on the meta device (``hspmd.cost.captured.planning_model``)."""
    if isinstance(model, LlamaConfig):
        return model  # no torch import
    from hspmd.cost.captured import planning_model

    return planning_model(model)


def run(args: argparse.Namespace) -> int:
    if args.timeline:
        from hspmd.viz.common import check_picture_path

        check_picture_path(args.timeline, flag="--timeline")  # before the work
    if args.trace:
        check_out_folder(args.trace, "--trace")
    planned = read_run(
        args,
        StrategyOptions(
            zero=zero_of(args), zero_shares=shares_of(args), sequence_parallel=args.sequence_parallel,
            recompute=args.recompute, schedule=args.schedule, dtype=args.dtype,
        ),
    )  # fmt: skip
    if planned.options.dtype != args.dtype:  # the plan's dtype prices the run
        args.dtype = planned.options.dtype
    config, cost, seq_len = setup(args, planned.model, planned.seq_len)
    strategy = planned.strategy
    options = planned.options
    check_strategy(
        strategy, config, global_batch=args.global_batch, options=options, seq_len=seq_len,
        world_size=cost.num_ranks,
    )  # fmt: skip
    prediction = predict(strategy, config, cost, seq_len=seq_len, options=options)
    if args.timeline:  # the picture of `hspmd train --timeline`, from predicted times
        from hspmd.viz.timeline import bars_from_result, draw_timeline

        title = f"{config.name}: {strategy}\npredicted step {prediction.step_time_s:.4g} s"
        draw_timeline(bars_from_result(prediction.result), args.timeline, title=title)
    if args.trace:
        from hspmd.sim.trace import write_trace

        write_trace(prediction.result, args.trace, rank_names=_rank_names(cost))
    if args.json:
        print(json.dumps(prediction.to_json(cost)))
    else:
        print(prediction_text(prediction, cost, model=config.name, seq_len=seq_len))
    return 0 if prediction.fits else 1


def _rank_names(cost: CostModel) -> dict[int, str]:
    return {r: f"rank {r} ({cost.kind_of(r)})" for r in range(cost.num_ranks)}


def prediction_text(p: Prediction, cost: CostModel, *, model: str, seq_len: int) -> str:
    """Step time, one row per stage (its ranks are alike), the critical path."""
    tokens = p.strategy.global_batch * seq_len
    stages = list(p.strategy.stages())
    # columns as wide as their longest entry (GPU kind names run from "H20" to "netns-cpu")
    kw = 1 + max(7, *(len(cost.kind_of(st.ranks[0])) for _, _, st in stages))
    rw = 1 + max(9, *(len(str(st).split(":")[0]) for _, _, st in stages))
    lines = [
        f"{model} on {cost.cluster.name} ({p.strategy.num_ranks} of {cost.num_ranks} ranks), "
        f"seq_len {seq_len}, global batch {p.strategy.global_batch}, {p.options}",
        f"predicted step time: {p.step_time_s:.4g} s ({tokens / p.step_time_s:,.0f} tokens/s)",
        f"{'stage':<8}{'ranks':<{rw}}{'kind':<{kw}}{'layers':<9}{'F ms':>9}{'B ms':>9}"
        f"{'busy s':>9}{'comm s':>9}{'idle s':>9}{'peak GiB':>10}{'cap GiB':>9}",
    ]
    res = p.result
    for pi, si, stage in stages:
        r = stage.ranks[0]
        work, mem = p.work[(pi, si)], p.memory[r]
        cap = cost.device_of(r).memory_bytes
        ranks = str(stage).split(":")[0]
        lines.append(
            f"{f'p{pi}s{si}':<8}{ranks:<{rw}}{cost.kind_of(r):<{kw}}"
            f"{f'{stage.first_layer}-{stage.last_layer}':<9}"
            f"{work.forward_s * 1e3:9.2f}{work.backward_s * 1e3:9.2f}"
            f"{res.busy.get(r, 0.0):9.3f}{res.comm.get(r, 0.0):9.3f}"
            f"{res.idle.get(r, 0.0):9.3f}{mem.peak / GIB:10.1f}{cap / GIB:9.1f}"
            + ("  OVER" if r in p.over else "")
        )  # fmt: skip
    path = p.result.critical_path()
    shown = path if len(path) <= 12 else [*path[:6], f"... ({len(path) - 12} more) ...", *path[-6:]]
    lines.append("critical path: " + " -> ".join(shown))
    for rank, (peak, cap) in sorted(p.over.items())[:1]:
        lines.append(
            f"does not fit: rank {rank} ({cost.kind_of(rank)}) needs {peak / GIB:.1f} GiB, "
            f"has {cap / GIB:.1f} GiB ({len(p.over)} ranks over): use more stages, TP, "
            "--zero1, --recompute or a smaller micro-batch"
        )
    return "\n".join(lines)
