"""`hspmd plan --data`: length-aware strategies for a corpus (docs/mixed-length.md).

    hspmd plan --data corpus.jsonl --max-seq-len 256 --tokens-per-step 1024 --out plans.json
    hspmd plan --data corpus.jsonl --max-seq-len 32768 --tokens-per-step 200000 \\
        --model llama-32b --cluster h20x32 --zero1 on --out plans.json
    hspmd plan --data corpus.jsonl --max-seq-len 64 --tokens-per-step 256 \\
        --model my_model.py:make --config '{"n_layer": 4}' --out plans.json

``--model`` is a preset or any captured model (a factory, ``hf:DIR``), costed from its
graph (docs/planner.md, "Any model"). Reads the documents (as ``hspmd train --data`` splits
them), makes their length histogram, runs the DP per maximum length
(``hspmd.planner.lengths``) and writes the strategies with their length ranges, the cost
lines the dispatch needs and the predicted switch times. Without ``--cluster`` it plans for
``--nproc`` local processes (``planner.local``; ``--slowdown R=F``: slowed ones). With
``--alive RANKS`` it plans for elastic training with the one planner (``planner.combined``):
only those ranks, kinds apart, ``--min-replicas`` pipelines holding every layer, ZeRO off;
the switch times are the states' fused BSR.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

from hspmd.cli.model_input import model_kwargs
from hspmd.cli.paths import write_out
from hspmd.cli.simulate import costed_model
from hspmd.cli.train import parse_slowdown
from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.data import DEFAULT_MAX_BYTES, document_steps, load_documents, split_documents
from hspmd.models import get_model
from hspmd.models.spec import ModuleModel
from hspmd.plan.strategy import StrategyOptions, parse_ranks
from hspmd.planner.combined import LengthPlanner, StatesSwitch
from hspmd.planner.lengths import (
    Histogram,
    LengthPlanError,
    LengthStrategy,
    load_plans,
    option_sets,
    plan_strategies,
    plans_json,
    switch_matrix,
)
from hspmd.planner.local import local_cost
from hspmd.train.config import LengthPlans, SwitchMode, TrainConfig
from hspmd.train.packing import planned_steps

SAMPLE_STEPS = 32  # sample steps the strategies are chosen on (planner.length_candidates)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mixed-length data (docs/mixed-length.md)")
    group.add_argument(
        "--data", default=None, help="plan for this corpus's lengths (text or JSONL)"
    )
    group.add_argument("--max-seq-len", type=int, default=None, help="with --data: the longest row")
    group.add_argument(
        "--tokens-per-step", type=int, default=None, help="with --data: tokens a step"
    )
    group.add_argument(
        "--nproc", type=int, default=4, help="with --data, no --cluster: local ranks"
    )
    group.add_argument("--strategies", type=int, default=4, help="with --data: maximum lengths planned")  # fmt: skip
    group.add_argument(
        "--slowdown", default="", metavar="RANK=FACTOR,...",
        help="with --data, no --cluster: local ranks that run slower (a kind of their own)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.max_seq_len is None or args.tokens_per_step is None:
        raise LengthPlanError("--data needs --max-seq-len L and --tokens-per-step N")
    if args.max_seq_len < 1 or args.tokens_per_step < args.max_seq_len:
        raise LengthPlanError(
            f"--max-seq-len {args.max_seq_len}, --tokens-per-step {args.tokens_per_step}: give "
            "a positive maximum and at least that many tokens a step"
        )
    if args.strategies < 1:
        raise LengthPlanError(f"--strategies {args.strategies}: plan at least 1 maximum length")
    model = args.model or "llama-tiny"
    config = costed_model(get_model(model, **dict(model_kwargs(args.config))))
    if args.max_seq_len > config.max_seq_len:
        raise LengthPlanError(
            f"--max-seq-len {args.max_seq_len} exceeds {config.name}'s longest sequence "
            f"({config.max_seq_len}): plan for at most that"
        )
    if args.cluster:
        cost = CostModel.of(load_cluster(args.cluster), dtype=args.dtype)
        cluster = args.cluster
    else:
        slow = dict(parse_slowdown(args.slowdown))
        cost, cluster = (
            local_cost(args.nproc, dtype=args.dtype, slowdown=slow),
            f"local-{args.nproc}",
        )
    docs = split_documents(load_documents(args.data, max_bytes=DEFAULT_MAX_BYTES))
    hist = Histogram.of([len(d) for d in docs], max_len=args.max_seq_len,
                        smallest=max(1, args.max_seq_len >> (args.strategies + 2)))  # fmt: skip
    zero1 = {"on": [True], "off": [False], "auto": [False, True]}[args.zero1]
    # a captured model trains without --sequence-parallel yet (TrainConfig.check_model)
    sp = not isinstance(config, ModuleModel)
    options = [
        o for z in zero1
        for o in option_sets(StrategyOptions(zero=int(z), sequence_parallel=sp, dtype=args.dtype),
                             config.num_layers)
    ]  # fmt: skip
    samples = [  # steps of this corpus (seed 1, not the training order) to choose on
        list(s.lengths) for s in islice(document_steps(
            args.tokens_per_step, 1, max_len=args.max_seq_len, path=args.data,
            max_bytes=DEFAULT_MAX_BYTES), SAMPLE_STEPS)
    ]  # fmt: skip
    plans, switch = _plans(args, config, cost, hist, samples, options)
    data = plans_json(plans, hist, model=model, cluster=cluster, step_tokens=args.tokens_per_step,
                      switch=switch)  # fmt: skip
    if args.out:
        write_out(args.out, json.dumps(data, indent=1) + "\n")
    if args.json:
        print(json.dumps(data))
        return 0
    print(f"{model} on {cluster} ({cost.num_ranks} ranks), {len(docs)} documents, "
          f"{args.tokens_per_step} tokens a step, lengths up to {args.max_seq_len}")  # fmt: skip
    for p in plans:
        ranges = ", ".join(f"{s.model.config} {lo}-{hi}"
                           for s, (lo, hi) in zip(p.pipes, p.intervals, strict=True))  # fmt: skip
        print(f"max {p.max_len}: {p.strategy}  [{ranges}]  predicted {p.predicted_s:.4g} s")
    return 0


def _plans(
    args: argparse.Namespace, config: Any, cost: CostModel, hist: Histogram,
    samples: list[list[int]], options: list[StrategyOptions],
) -> tuple[list[LengthStrategy], list[list[float]]]:  # fmt: skip
    """The strategies and their switch matrix: the length planner's, or with ``--alive``
    (elastic) the one planner's over those ranks (switches of the states)."""
    if args.alive is not None:
        found = LengthPlanner(config, cost, min_replicas=args.min_replicas).plan(
            hist, alive=parse_ranks(args.alive), step_tokens=args.tokens_per_step,
            count=args.strategies, samples=samples,
        )  # fmt: skip
        return list(found.plans), StatesSwitch(found.plans, config, cost).matrix()
    plans = plan_strategies(config, cost, hist, step_tokens=args.tokens_per_step,
                            options=options, count=args.strategies, samples=samples)  # fmt: skip
    return plans, switch_matrix(plans, config, cost)


def read_plans_file(path: str) -> tuple[LengthPlans, dict[str, Any]]:
    """``hspmd train --plans FILE``: the plans as values, read once here, and the file's
    JSON (errors: one line)."""
    try:
        text = Path(path).read_text()
        data = json.loads(text)
    except OSError as error:
        raise LengthPlanError(f"--plans {path}: cannot read it ({error.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LengthPlanError(f"--plans {path}: not JSON ({error}): write it with `hspmd plan --data`") from None  # fmt: skip
    return read_length_plans(data, f"--plans {path}"), data


def read_length_plans(data: Any, where: str) -> LengthPlans:
    """A plans file's JSON as values (``where`` names it in errors)."""
    plans, switch = load_plans(data, where)
    return LengthPlans(plans=tuple(plans), switch_s=tuple(tuple(row) for row in switch))


def apply_plans(config: TrainConfig, plans: LengthPlans, *, path: str) -> TrainConfig:
    """``config`` under a plans file: it starts under the first step's chosen strategy;
    the later steps are chosen while training runs (``hspmd.train.plan_ahead``), with a
    switch (bf16 weights only) before each step whose choice differs from the one before.
    Sequence parallelism is the file's; each strategy recomputes as the file says
    (``train.active.strategy_options``; the run's flags carry the most any asks)."""
    if config.strategy is not None or config.switching.switches:
        raise LengthPlanError(f"--plans {path} chooses every step's strategy: drop --strategy and --switch")  # fmt: skip
    # an elastic run moves the states (two holders each), not weights around a home layout
    mode: SwitchMode = "states" if config.elastic.enabled else "weights"
    config = replace(config, switching=replace(config.switching, length_plans=plans, mode=mode))
    options = [p.options for p in plans.plans]
    recompute = [o for o in options if o.recompute]
    given = config.options
    config = replace(config, options=replace(
        given,
        sequence_parallel=given.sequence_parallel or any(o.sequence_parallel for o in options),
        recompute=given.recompute or bool(recompute),
        recompute_layers=given.recompute_layers if given.recompute else _most(recompute),
    ))  # fmt: skip
    # the elastic chooser (hspmd.train.elastic_lengths): with its fallbacks
    if config.elastic.enabled:
        from hspmd.train.elastic_lengths import Lengths

        return replace(config, strategy=Lengths(config).choose(1, None).strategy)
    first = next(planned_steps(replace(config, steps=1)))
    return replace(config, strategy=plans.plans[first.plan or 0].strategy)


def _most(recompute: list[StrategyOptions]) -> int:
    """The ``recompute_layers`` that recomputes at least what each of them does."""
    if not recompute or any(o.recompute_layers == 0 for o in recompute):
        return 0
    return max(o.recompute_layers for o in recompute)
