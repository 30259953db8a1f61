"""Mixed-length data: six ways to train the same steps, side by side in one run (simulation).

The paper's setting (scenario (c), Figures 17-18): llama-32b on 32 H20 (the shipped
``h20x32`` cluster: 4 nodes of 8, NVLink within, one 50 GB/s NIC per GPU across), bf16,
sequence parallelism, about 200K tokens per step, contexts 16K and 32K. Document lengths
(tokens) are drawn, seeded, from two long-tailed distributions standing in for the paper's
corpora (its exact histograms are not published as numbers):

- ``commoncrawl``: lognormal, median 700 tokens, sigma 1.2 (98% under 8K, as the paper's
  "97% under 8K"; 0.4% over 16K);
- ``github``: lognormal, median 900 tokens, sigma 1.7 (a heavier tail: 90% under 8K, 4%
  over 16K).

A document over the context is truncated to it. Each step takes documents until the next
would pass the step's tokens. Every method below is costed by the same model
(``hspmd.planner.lengths``: ``cost.stage.stage_work`` per row, exact in the quadratic
attention term, 1F1B fill and drain, the gradient all-reduce and Adam once per step,
memory checked per configuration), over the same steps:

- ``deepspeed``: the paper's Table 13 DeepSpeed plan (16K: ``DP8SP4AC``, 32K:
  ``DP4SP8AC``, micro-batch 1: ZeRO-3 over every rank, Ulysses SP, activation
  checkpointing), simulated by ``hspmd.planner.deepspeed``: the step's documents packed
  into windows of the context (the last one taken whole), ``dp`` windows at a time;
- ``full-window``: Megatron's default: the step's documents concatenated and cut into
  windows of the context, attention across the documents of a window (``L^2`` per
  window), windows round-robin over the pipelines of the best homogeneous DP x TP x CP x
  PP (best over every configuration that fits, with recompute off, on, or on for the
  first k = 1, 2, 4, ... layers of each stage as Megatron's ``--recompute-num-layers``,
  the same option sets ours gets, by the mean over the steps);
- ``varlen``: the same homogeneous search, document-masked attention (each document's
  ``l^2``), documents packed into rows of the context by the balanced best-fit dispatch;
- ``hotspa``: HotSPa-style: each step's documents grouped by the smallest bucket (4K, 8K,
  16K, 32K) that holds them, each group run with the best homogeneous strategy for its
  bucket, one after another, switching the bf16 weights between them (the fused BSR
  estimate), the step's sync once;
- ``ours``: ``plan_strategies`` (one strategy per maximum length: the DP's or a
  homogeneous one, the fastest on 16 sample steps of another seed) and per step
  ``choose`` (dispatch by the cost model, least predicted time including the switch);
- ``ideal``: the step's FLOPs (document-masked) on every GPU at the achieved rate, nothing
  else (the bound).

    .venv/bin/python benchmarks/mixed_length.py [--steps 16]
    .venv/bin/python benchmarks/mixed_length.py --part local   (real processes here)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.config import get_config
from hspmd.plan.strategy import StrategyOptions
from hspmd.planner.deepspeed import parse_deepspeed, predict_deepspeed
from hspmd.planner.lengths import (
    Histogram,
    LengthStrategy,
    PipeModel,
    PipeSpec,
    choose,
    dispatch,
    ideal_seconds,
    option_sets,
    pipe_configs,
    plan_strategies,
    step_seconds,
    switch_seconds,
    sync_seconds,
    to_strategy,
)

DISTRIBUTIONS = {"commoncrawl": (700, 1.2), "github": (900, 1.7)}
TABLE13_DEEPSPEED = {16384: "DP8SP4AC, bs1", 32768: "DP4SP8AC, bs1"}  # the paper's Table 13
STEP_TOKENS = 200_000
BUCKETS = (4096, 8192, 16384, 32768)


def sample(name: str, count: int, max_len: int, seed: int) -> list[int]:
    median, sigma = DISTRIBUTIONS[name]
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(median), sigma, count)
    return [int(min(max(1, round(x)), max_len)) for x in raw]


def steps_of(lengths: list[int], tokens: int, count: int) -> list[list[int]]:
    out, at = [], 0
    for _ in range(count):
        step: list[int] = []
        while at < len(lengths) and sum(step) + lengths[at] <= tokens:
            step.append(lengths[at])
            at += 1
        if not step:
            step.append(lengths[at])
            at += 1
        out.append(step)
    return out


def homogeneous(model: PipeModel, gpus: int, row_len: int, config: Any, cost: CostModel,
                options: StrategyOptions) -> LengthStrategy:  # fmt: skip
    n = gpus // model.config.gpus
    pipes = tuple(PipeSpec(model, row_len) for _ in range(n))
    strategy = to_strategy(pipes, config.num_layers)
    return LengthStrategy(row_len, pipes, ((1, row_len),) * n, 0.0,
                          sync_seconds(strategy, config, cost, zero1=options.zero1), strategy,
                          options)  # fmt: skip


def full_window_seconds(step: list[int], plan: LengthStrategy) -> float:
    """Windows of the context, round-robin over the pipelines, ``L^2`` attention."""
    L, n = plan.max_len, len(plan.pipes)
    windows = []
    total = sum(step)
    while total > 0:
        windows.append(min(L, total))
        total -= L
    per: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    for i, w in enumerate(windows):
        per[i % n].append((w, float(w) * w))
    return max(p.model.seconds(rows) for p, rows in zip(plan.pipes, per, strict=True)) + plan.sync_s


def best_homogeneous(candidates: list[LengthStrategy], steps: list[list[int]], fn: Any) -> tuple[LengthStrategy, list[float]]:  # fmt: skip
    best = None
    for plan in candidates:
        times = [fn(step, plan) for step in steps]
        if best is None or statistics.mean(times) < statistics.mean(best[1]):
            best = (plan, times)
    assert best is not None
    return best


def run_case(dist: str, max_len: int, n_steps: int, seed: int) -> dict[str, Any]:
    config = get_config("llama-32b")
    cost = CostModel.of(load_cluster("h20x32"))
    gpus = cost.num_ranks
    base = StrategyOptions(sequence_parallel=True, dtype="bf16", zero=1)
    options = option_sets(base, config.num_layers)
    lengths = sample(dist, 60_000, max_len, seed)
    steps = steps_of(lengths, STEP_TOKENS, n_steps)
    hist = Histogram.of(lengths, max_len=max_len, smallest=1024)
    t0 = time.perf_counter()
    samples = steps_of(sample(dist, 60_000, max_len, seed + 1), STEP_TOKENS, 16)  # not the steps
    plans = plan_strategies(config, cost, hist, step_tokens=STEP_TOKENS, options=options,
                            samples=samples)  # fmt: skip
    plan_s = time.perf_counter() - t0

    def homs(row_len: int) -> list[LengthStrategy]:
        out = []
        for opts in options:
            for z in (1, 2, 4, 8, 16, 32):
                for m in pipe_configs(config, cost, options=opts, max_len=max_len, replicas=z):
                    n = gpus // m.config.gpus
                    if m.fit_len >= row_len and gpus % m.config.gpus == 0 and n == z:
                        out.append(homogeneous(m, gpus, row_len, config, cost, opts))
        return out

    full_plan, full = best_homogeneous(homs(max_len), steps, full_window_seconds)
    ds_plan = parse_deepspeed(TABLE13_DEEPSPEED[max_len])
    ds_steps: dict[int, Any] = {}  # windows a step -> the simulated step

    def deepspeed_seconds(step: list[int]) -> float:
        """Windows of the context (the last one taken whole), ``dp`` at a time in lock step."""
        windows = -(-sum(step) // max_len)
        if windows not in ds_steps:
            ds_steps[windows] = predict_deepspeed(ds_plan, config, cost, global_batch=windows,
                                                  seq_len=max_len)  # fmt: skip
        return ds_steps[windows].step_time_s

    deepspeed = [deepspeed_seconds(step) for step in steps]

    def varlen_fn(step: list[int], plan: LengthStrategy) -> float:
        return step_seconds(dispatch(step, plan), plan)

    var_plan, varlen = best_homogeneous(homs(max_len), steps, varlen_fn)

    # HotSPa: one homogeneous strategy per bucket, chosen on that bucket's groups
    buckets = [b for b in BUCKETS if b <= max_len]
    groups = [[[n for n in step if _bucket(n, buckets) == b] for step in steps] for b in buckets]
    per_bucket = {}
    for b, gs in zip(buckets, groups, strict=True):
        present = [g for g in gs if g]
        if present:
            per_bucket[b] = best_homogeneous(homs(b), present, varlen_fn)[0]
    switch_cache: dict[tuple[str, str], float] = {}

    def switch(a: LengthStrategy, b: LengthStrategy) -> float:
        key = (str(a.strategy), str(b.strategy))
        if key[0] == key[1]:
            return 0.0
        if key not in switch_cache:
            switch_cache[key] = switch_seconds(a.strategy, b.strategy, config, cost)
        return switch_cache[key]

    hotspa, hotspa_switches, current = [], 0, None
    for step in steps:
        present = [b for b in buckets if any(_bucket(n, buckets) == b for n in step)]
        if current in present:  # start with the strategy running now
            present.remove(current)
            present.insert(0, current)
        total = 0.0
        for b in present:
            plan = per_bucket[b]
            group = [n for n in step if _bucket(n, buckets) == b]
            total += step_seconds(dispatch(group, plan), plan) - plan.sync_s
            if current is not None and current != b:
                s = switch(per_bucket[current], plan)
                total += s
                hotspa_switches += s > 0
            current = b
        assert current is not None
        hotspa.append(total + per_bucket[current].sync_s)

    ours, ours_switches, chosen, here = [], 0, [], None
    for a in plans:  # the switch estimates, before timing the choices
        for b in plans:
            switch(a, b)
    t_choose = time.perf_counter()
    for step in steps:
        k, t, s = choose(step, plans, current=here,
                         switch=lambda a, b: switch(plans[a], plans[b]))  # fmt: skip
        ours.append(t + s)
        ours_switches += s > 0
        chosen.append(plans[k].max_len)
        here = k
    choose_s = (time.perf_counter() - t_choose) / len(steps)
    ideal = [ideal_seconds(step, config, cost) for step in steps]
    switches = [v for v in switch_cache.values() if v > 0]
    mean = statistics.mean
    return {
        "case": f"{dist} {max_len // 1024}K", "steps": n_steps,
        "tokens_per_step": mean(sum(s) for s in steps),
        "docs_per_step": mean(len(s) for s in steps),
        "under_8k": sum(n < 8192 for n in lengths) / len(lengths),
        "full_window_s": mean(full), "varlen_s": mean(varlen), "hotspa_s": mean(hotspa),
        "deepspeed_s": mean(deepspeed), "deepspeed_plan": str(ds_plan),
        "deepspeed_fits": all(p.fits for p in ds_steps.values()),
        "ours_s": mean(ours), "ideal_s": mean(ideal),
        "hotspa_switches": hotspa_switches, "ours_switches": ours_switches,
        "ours_chosen": {str(m): chosen.count(m) for m in sorted(set(chosen))},
        "plan_s": plan_s, "choose_s": choose_s,
        "switch_s": (min(switches), max(switches)) if switches else (0.0, 0.0),
        "full_window_plan": _describe(full_plan), "varlen_plan": _describe(var_plan),
        "hotspa_plans": {str(b): _describe(p) for b, p in per_bucket.items()},
        "ours_plans": {str(p.max_len): _describe(p) for p in plans},
    }  # fmt: skip


def _bucket(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if n <= b)


def _describe(plan: LengthStrategy) -> str:
    parts: dict[str, int] = {}
    for p in plan.pipes:  # a pipeline's recompute: its stages' first k layers (:RC<k>)
        rc = f" RC{p.model.redo}" if p.model.redo else ""
        key = f"{p.model.config}@{p.row_len // 1024}K{rc}"
        parts[key] = parts.get(key, 0) + 1
    return " + ".join(f"{n}x{k}" for k, n in parts.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("sim", "local", "all"), default="sim",
                        help="sim: the paper's setting simulated; local: real processes here "
                        "(benchmarks/mixed_length_local.py)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=16, help="steps per case (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-len", type=int, default=4096, help="local: the context")
    parser.add_argument("--tokens", type=int, default=8192, help="local: tokens a step")
    parser.add_argument("--local-steps", type=int, default=6, help="local: steps a run")
    parser.add_argument("--rounds", type=int, default=2, help="local: launches of the runs")
    parser.add_argument("--memory-mb", type=float, default=4000, help="local: each rank's "
                        "memory in the planners' cluster file (default 4000: one rank holds rows of up to "
                        "2048 tokens, longer ones need CP or TP, as GPU memory makes them)")  # fmt: skip
    parser.add_argument("--profile", default=None, help="local: a profile of this machine "
                        "(hspmd profile --nproc 4); measured now if not given")  # fmt: skip
    args = parser.parse_args()
    if args.part in ("sim", "all"):
        sim_part(args.steps, args.seed)
    if args.part in ("local", "all"):
        from mixed_length_local import local_part

        local_part(max_len=args.max_len, tokens=args.tokens, steps=args.local_steps,
                   rounds=args.rounds, profile=args.profile, memory_mb=args.memory_mb)  # fmt: skip


def sim_part(steps: int, seed: int) -> None:
    rows = []
    for dist in DISTRIBUTIONS:
        for max_len in (16384, 32768):
            rows.append(run_case(dist, max_len, steps, seed))
    head = (f"{'case':<16}{'deepspeed':>10}{'full-window':>12}{'varlen':>9}{'hotspa':>9}{'ours':>9}"
            f"{'ideal':>9}  (s/step)  vs DS  vs full  vs varlen  vs hotspa  ideal/ours")  # fmt: skip
    print(head)
    for r in rows:
        ds = f"{r['deepspeed_s']:.2f}" + ("" if r["deepspeed_fits"] else "!")
        print(
            f"{r['case']:<16}{ds:>10}{r['full_window_s']:12.2f}{r['varlen_s']:9.2f}"
            f"{r['hotspa_s']:9.2f}{r['ours_s']:9.2f}{r['ideal_s']:9.2f}            "
            f"{r['deepspeed_s'] / r['ours_s']:5.3f}"
            f"{r['full_window_s'] / r['ours_s']:9.3f}{r['varlen_s'] / r['ours_s']:10.3f}"
            f"{r['hotspa_s'] / r['ours_s']:11.3f}{r['ideal_s'] / r['ours_s']:12.3f}"
        )
    print("  deepspeed: the paper's Table 13 DeepSpeed plan (ZeRO-3 over DP x SP, Ulysses SP, "
          "checkpointing; hspmd.planner.deepspeed), full windows; !: over memory")  # fmt: skip
    for r in rows:
        print(f"{r['case']}: {r['docs_per_step']:.0f} docs, {r['tokens_per_step']:.0f} tokens a "
              f"step, {r['under_8k']:.1%} of documents under 8K; planning {r['plan_s']:.2f} s, "
              f"choosing {r['choose_s'] * 1e3:.1f} ms a step, switches {r['switch_s'][0]:.2f}-"
              f"{r['switch_s'][1]:.2f} s")  # fmt: skip
        print(f"  deepspeed {r['deepspeed_plan']}; full-window {r['full_window_plan']}; "
              f"varlen {r['varlen_plan']}")  # fmt: skip
        print(f"  hotspa {r['hotspa_plans']} ({r['hotspa_switches']} switches)")
        print(
            f"  ours {r['ours_plans']}; chosen {r['ours_chosen']} ({r['ours_switches']} switches)"
        )
    ratios = {
        r["case"]: {
            "vs_deepspeed": round(r["deepspeed_s"] / r["ours_s"], 4),
            "vs_full_window": round(r["full_window_s"] / r["ours_s"], 4),
            "vs_varlen": round(r["varlen_s"] / r["ours_s"], 4),
            "vs_hotspa": round(r["hotspa_s"] / r["ours_s"], 4),
            "of_ideal": round(r["ideal_s"] / r["ours_s"], 4),
        }
        for r in rows
    }
    print(json.dumps({"benchmark": "mixed_length", "part": "sim", "ratios": ratios}))


if __name__ == "__main__":
    main()
