"""The paper's three traces as one, in simulation: the elastic trace C1 -> C7 with mixed-length
data, our one planner against the best combination of separate tools (issue 39, item 3).

llama-32b on the shipped ``hetu-h800-h20`` cluster (2 nodes of 8 H800, ranks 0-15; 4 nodes of
8 H20, ranks 16-47), bf16, sequence parallel. The configurations are the elastic trace of
``benchmarks/elastic.py`` (the paper's Tables 10-12: C1 32 H20, C2 a GPU fails, C3 its node
leaves, C4 16 H800 join, C5 an H20 node leaves, C6 an H800 fails, C7 its node leaves); the
data is scenario (c)'s of ``benchmarks/mixed_length.py`` (CommonCrawl-like lognormal
lengths, median 700, sigma 1.2, up to ``--max-len``; about 200K tokens a step). Every step
time comes from the length planner's row model (``PipeModel``: ``o + a tokens + q
squares`` per packed row, 1F1B fill and drain, the gradient sync), the fixed-window
baseline's from the simulator (``planner.predict``), on the same cluster file.

- **ours**: ``planner.combined.LengthPlanner`` over the alive GPUs (both kinds, two
  pipelines or more, ZeRO off), warm-started from the previous configuration's set; per
  step the strategy of the set with the least predicted time plus the switch of the states
  from the one running (``length_dispatch.choose``). A change costs the measured planning
  seconds, ``--specialize-s`` (the paper's 7.05 s, not measured here), the predicted
  fused BSR of masters and Adam moments from the strategy running to the new set's first
  choice (dead ranks own nothing), and half a step on a failure.
- **elastic + fixed windows** (separate tool 1): ``planner.elastic.replan`` (two replicas,
  ZeRO off, warm-started) for ``ceil(200K / max-len)`` windows of ``--max-len`` tokens a
  step (documents packed and cut into fixed windows, full attention over each): its
  predicted step. Changes cost as ours (its measured planning seconds).
- **lengths + restart** (separate tool 2): ``planner.lengths.plan_strategies`` (ZeRO-1 on
  or off, one GPU kind: on configurations with both kinds the better kind alone) on the
  whole nodes a restart keeps (a failed GPU's node is dropped, as in
  ``benchmarks/elastic.py``), per-step choice with its weights switches; every change of
  its GPU set costs ``--restart-s`` (default: ``elastic.restart_default``, a model, 106 s)
  and a failure half a step.

Each configuration runs ``--steps`` steps (default 50; the paper gives no lengths); per
step times are the mean over ``--sample-steps`` steps of the data (another stream per
configuration). Ratios are baseline / ours.

    PYTHONPATH=src .venv/bin/python benchmarks/all_three.py [--max-len 32768] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from elastic import SPECIALIZE_S, STORAGE_GBPS, TRACE, _kept_cluster, restart_default  # noqa: E402
from mixed_length import STEP_TOKENS, sample, steps_of  # noqa: E402

from hspmd.cost.cluster import load_cluster  # noqa: E402
from hspmd.cost.lines import CostModel  # noqa: E402
from hspmd.models.config import get_config  # noqa: E402
from hspmd.plan.strategy import StrategyOptions  # noqa: E402
from hspmd.planner.combined import LengthPlanner, LengthSet, StatesSwitch  # noqa: E402
from hspmd.planner.elastic import ElasticPlanError, replan, switch_estimate  # noqa: E402
from hspmd.planner.length_dispatch import choose, switch_seconds  # noqa: E402
from hspmd.planner.length_model import Histogram, LengthPlanError, LengthStrategy  # noqa: E402
from hspmd.planner.lengths import option_sets, plan_strategies  # noqa: E402

MODEL = "llama-32b"
DIST = "commoncrawl"


def _run_steps(
    plans: list[LengthStrategy], steps: list[list[int]], switch: Any, start: int | None
) -> tuple[float, int | None, int]:
    """Mean seconds a step (switches included), the strategy left running, switches."""
    times, here, switches = [], start, 0
    for step in steps:
        k, t, s = choose(step, plans, current=here, switch=switch)
        times.append(t + s)
        switches += here is not None and k != here
        here = k
    return statistics.mean(times), here, switches


def _ours(
    planner: LengthPlanner, hist: Histogram, c: Any, steps: list[list[int]],
    samples: list[list[int]], state: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """Our set for ``c``, its steps, and the change's cost from the set before."""
    previous: LengthSet | None = state.get("set")
    found = planner.plan(hist, alive=c.alive, step_tokens=STEP_TOKENS, samples=samples,
                         previous=previous)  # fmt: skip
    plans = list(found.plans)
    switch = StatesSwitch(plans, planner.config, planner.cost)
    first, _, _ = choose(steps[0], plans, current=None, switch=switch)
    move = 0.0
    if previous is not None and state.get("running") is not None:
        running = previous.plans[state["running"]].strategy
        dead = set(running.ranks) - set(c.alive)
        move = switch_estimate(running, plans[first].strategy, planner.config, planner.cost,
                               dead=dead).seconds  # fmt: skip
    mean, here, switches = _run_steps(plans, steps, switch, first)
    state["set"], state["running"] = found, here
    return {"ours_s": mean, "ours_plan_s": found.plan_seconds, "ours_move_s": move,
            "ours_switches": switches, "ours_kept": found.kept,
            "ours_set": [str(p.strategy) for p in plans]}  # fmt: skip


def _elastic_windows(
    config: Any, cost: CostModel, c: Any, max_len: int, state: dict[str, Any]
) -> dict[str, Any]:
    """The elastic planner's plan for fixed windows of ``max_len`` tokens."""
    batch = max(2, math.ceil(STEP_TOKENS / max_len))
    current = state.get("elastic")
    try:
        p = replan(config, cost, alive=c.alive, current=current, global_batch=batch,
                   seq_len=max_len)  # fmt: skip
    except ElasticPlanError as error:
        return {"windows_s": math.inf, "windows_error": str(error)[:120]}
    state["elastic"] = p.strategy
    move = p.switch.seconds if p.switch is not None else 0.0
    return {"windows_s": p.step_time_s, "windows_plan_s": p.plan_seconds,
            "windows_move_s": move, "windows_batch": batch}  # fmt: skip


def _lengths_restart(
    config: Any, full: Any, c: Any, hist: Histogram, steps: list[list[int]],
    samples: list[list[int]],
) -> dict[str, Any]:  # fmt: skip
    """The length planner on one kind's kept nodes (the better kind where both are)."""
    h800, h20 = c.megatron_nodes
    options = [o for z in (0, 1) for o in option_sets(
        StrategyOptions(zero=z, sequence_parallel=True, dtype="bf16"), config.num_layers)]  # fmt: skip
    best: dict[str, Any] = {"lengths_s": math.inf}
    for nodes in ((h800, 0), (0, h20)):
        if not sum(nodes):
            continue
        cost = CostModel.of(_kept_cluster(full, nodes))
        try:
            plans = plan_strategies(config, cost, hist, step_tokens=STEP_TOKENS, options=options,
                                    samples=samples)  # fmt: skip
        except LengthPlanError:
            continue
        switch = _weights_switch(plans, config, cost)
        mean, _, _ = _run_steps(plans, steps, switch, None)
        if mean < best["lengths_s"]:
            best = {"lengths_s": mean, "lengths_gpus": cost.num_ranks,
                    "lengths_kind": "H800" if nodes[0] else "H20"}  # fmt: skip
    return best


def _weights_switch(plans: list[LengthStrategy], config: Any, cost: CostModel) -> Any:
    """The length planner's switch (bf16 weights, ``switch_seconds``), kept per pair."""
    cache: dict[tuple[int, int], float] = {}

    def switch(a: int, b: int) -> float:
        if (a, b) not in cache:
            cache[a, b] = switch_seconds(plans[a].strategy, plans[b].strategy, config, cost)
        return cache[a, b]

    return switch


def _totals(rows: list[dict[str, Any]], args: argparse.Namespace, restart: float) -> dict[str, Any]:  # fmt: skip
    """Each method's trace time: steps, and the changes' overheads."""
    out = {"ours": 0.0, "windows": 0.0, "lengths": 0.0}
    prev: dict[str, Any] | None = None
    for row in rows:
        for m in out:
            out[m] += args.steps * row[f"{m}_s"]
        if prev is None:
            row["ours_overhead_s"] = row["windows_overhead_s"] = row["lengths_overhead_s"] = 0.0
        else:
            lost = {m: 0.5 * prev[f"{m}_s"] if row["event"] == "failure" else 0.0 for m in out}
            row["ours_overhead_s"] = (row["ours_plan_s"] + args.specialize_s + row["ours_move_s"]
                                      + lost["ours"])  # fmt: skip
            row["windows_overhead_s"] = (row.get("windows_plan_s", 0.0) + args.specialize_s
                                         + row.get("windows_move_s", 0.0) + lost["windows"])  # fmt: skip
            same = row["lengths_gpus_set"] == prev["lengths_gpus_set"]
            row["lengths_overhead_s"] = (0.0 if same else restart) + lost["lengths"]
        for m in out:
            out[m] += row[f"{m}_overhead_s"]
        prev = row
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = get_config(MODEL)
    full = load_cluster("hetu-h800-h20")
    cost = CostModel.of(full)
    lengths = sample(DIST, 60_000, args.max_len, args.seed)
    hist = Histogram.of(lengths, max_len=args.max_len, smallest=1024)
    samples = steps_of(sample(DIST, 60_000, args.max_len, args.seed + 1), STEP_TOKENS, 16)
    restart = args.restart_s if args.restart_s is not None else restart_default(config, STORAGE_GBPS)  # fmt: skip
    planner = LengthPlanner(config, cost)
    began = time.perf_counter()
    planner.warm(args.max_len)  # every kind's row models, before the trace (as at start)
    warm_s = time.perf_counter() - began
    rows, ours_state, elastic_state = [], {}, {}  # type: ignore[var-annotated]
    for i, c in enumerate(TRACE):
        pool = sample(DIST, 60_000, args.max_len, args.seed + 10 + i)
        steps = steps_of(pool, STEP_TOKENS, args.sample_steps)
        row: dict[str, Any] = {"config": c.name, "event": c.event, "gpus": len(c.alive),
                               "lengths_gpus_set": c.megatron_nodes}  # fmt: skip
        row |= _ours(planner, hist, c, steps, samples, ours_state)
        row |= _elastic_windows(config, cost, c, args.max_len, elastic_state)
        row |= _lengths_restart(config, full, c, hist, steps, samples)
        rows.append(row)
        print(f"  {c.name} done", file=sys.stderr, flush=True)
    totals = _totals(rows, args, restart)
    return {"rows": rows, "totals": totals, "restart_s": restart, "warm_s": warm_s}


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    rows, totals = result["rows"], result["totals"]
    print(f"{MODEL} on hetu-h800-h20, {DIST} lengths up to {args.max_len}, about "
          f"{STEP_TOKENS} tokens a step, {args.steps} steps a configuration")  # fmt: skip
    print("| cfg | GPUs | ours s | elastic+windows s | lengths+restart s (GPUs, kind) | "
          "x best | plan s | move s | ovh ours | ovh windows | ovh lengths |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = min(r["windows_s"], r["lengths_s"])
        print(f"| {r['config']} | {r['gpus']} | {r['ours_s']:.2f} | {r['windows_s']:.2f} | "
              f"{r['lengths_s']:.2f} ({r.get('lengths_gpus', '-')}, {r.get('lengths_kind', '-')}) | "
              f"{best / r['ours_s']:.2f} | {r['ours_plan_s']:.2f} | {r['ours_move_s']:.2f} | "
              f"{r['ours_overhead_s']:.1f} | {r['windows_overhead_s']:.1f} | "
              f"{r['lengths_overhead_s']:.1f} |")  # fmt: skip
    best = min(totals["windows"], totals["lengths"])
    print(f"trace total: ours {totals['ours']:.0f} s, elastic+windows {totals['windows']:.0f} s, "
          f"lengths+restart {totals['lengths']:.0f} s; best separate / ours "
          f"{best / totals['ours']:.2f}x")  # fmt: skip
    for r in rows:
        print(f"  {r['config']} ours set: {' | '.join(r['ours_set'])}")
    replans = [r["ours_plan_s"] for r in rows[1:]]
    print(f"re-planning (after C1): {min(replans):.2f}-{max(replans):.2f} s; row models at "
          f"start {result['warm_s']:.2f} s")  # fmt: skip
    summary = {
        "benchmark": "all_three", "model": MODEL, "max_len": args.max_len, "steps": args.steps,
        "totals_s": {k: round(v, 1) for k, v in totals.items()},
        "best_separate_over_ours": round(best / totals["ours"], 3),
        "replan_s": [round(x, 3) for x in replans], "restart_s": result["restart_s"],
        "rows": [{k: v for k, v in r.items() if k != "ours_set"} for r in rows],
    }  # fmt: skip
    print(json.dumps(summary, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=50, help="steps a configuration")
    parser.add_argument("--sample-steps", type=int, default=8, help="steps costed a configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--specialize-s", type=float, default=SPECIALIZE_S)
    parser.add_argument("--restart-s", type=float, default=None)
    args = parser.parse_args()
    report(run(args), args)


if __name__ == "__main__":
    main()
