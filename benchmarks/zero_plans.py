"""Sharded states on the paper's clusters, in simulation, side by side in one run.

Per case, every step time from the same simulator (``hspmd.planner.predict``):

- **ours**: ``hspmd plan``'s choice: per candidate plan the ZeRO stage (1, 2, 3) and, where
  a layer's replicas sit on devices of unequal memory, memory-proportional shares
  (``hspmd.planner.zero_choice``; docs/zero.md "The planner's choice");
- **even**: the same planner with even shards only (``--even-shares``);
- **ZeRO-1**: the same planner with stage 1 only and even shards (the planner before the
  choice); **Z1+sh**: stage 1 only, memory-proportional shares allowed (where ZeRO 2 and 3
  save nothing: pipelines out of lock step accumulate whole gradients, docs/zero.md);
- **DS paper**: the paper's DeepSpeed plan for the case where it gives one (Tables 8, 10:
  ZeRO-3 over all DP x SP ranks, Ulysses SP, activation checkpointing;
  ``hspmd.planner.deepspeed``), on the whole nodes it keeps;
- **DS best**: the fastest fitting DeepSpeed plan over DP x SP x micro-batch x checkpointing
  on those nodes (``best_deepspeed``).

Cases (llama presets, bf16, sequence parallelism; global batch and length per case):

    a-32b-16+32   llama-32b, 16 H800 + 32 H20 (hetu-h800-h20), B 64, 4K (Table 8 row)
    a-70b-16+16   llama-70b, 16 H800 + 16 H20 (hetu-h800-h20x16), B 64, 4K (Table 8 row)
    8+8-32b       llama-32b on one H800 node and one H20 node (R0-7, R16-23), B 64, 4K
    C6-70b        llama-70b on C6's GPUs (R0-14, R16-39: a failed H800), two pipelines
                  at least; DeepSpeed on the whole nodes (R0-7, R16-39), B 64, 4K
    fixed-16K     llama-32b, the strategy fixed to one TP-8 pipeline of H800 (R0-7) and one
                  of H20 (R16-23), 16K, B 16: the stage and shares of that strategy only

``--all`` adds the other four rows of Table 8. Ratios are other / ours.

    .venv/bin/python benchmarks/zero_plans.py          # about a minute
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.config import get_config
from hspmd.plan.strategy import StrategyOptions, parse_ranks, parse_strategy
from hspmd.planner.closed_form import fastest_fitting
from hspmd.planner.deepspeed import best_deepspeed, parse_deepspeed, predict_deepspeed
from hspmd.planner.predict import Prediction
from hspmd.planner.search import plan
from hspmd.planner.zero_choice import zero_predictions


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    cluster: str
    batch: int
    seq: int
    ranks: str | None = None  # alive ranks (None: all)
    deepspeed_ranks: str | None = None  # the whole nodes DeepSpeed keeps (None: ranks)
    deepspeed: str | None = None  # the paper's DeepSpeed plan
    fixed: str | None = None  # a fixed strategy: only its ZeRO stage and shares chosen


CASES = (
    Case("a-32b-16+32", "llama-32b", "hetu-h800-h20", 64, 4096, deepspeed="DP24SP2AC, bs1"),
    Case("a-70b-16+16", "llama-70b", "hetu-h800-h20x16", 64, 4096, deepspeed="DP16SP2AC, bs1"),
    Case("8+8-32b", "llama-32b", "hetu-h800-h20", 64, 4096, ranks="0-7,16-23"),
    Case("C6-70b", "llama-70b", "hetu-h800-h20", 64, 4096, ranks="0-14,16-39",
         deepspeed_ranks="0-7,16-39"),
    Case("fixed-16K", "llama-32b", "hetu-h800-h20", 16, 16384, ranks="0-7,16-23",
         fixed="8x1: R0-7:L0-59; 8x1: R16-23:L0-59"),
)  # fmt: skip
MORE = (  # --all: the rest of Table 8
    Case("a-32b-16+16", "llama-32b", "hetu-h800-h20x16", 64, 4096, deepspeed="DP16SP2AC, bs2"),
    Case("a-32b-16+24", "llama-32b", "hetu-h800-h20x24", 64, 4096, deepspeed="DP20SP2AC, bs4"),
    Case("a-70b-16+24", "llama-70b", "hetu-h800-h20x24", 64, 4096, deepspeed="DP20SP2AC, bs2"),
    Case("a-70b-16+32", "llama-70b", "hetu-h800-h20", 64, 4096, deepspeed="DP24SP2AC, bs1"),
)  # fmt: skip


def _ours(case: Case, config: Any, cost: CostModel, **kw: Any) -> Prediction:
    """The planner's plan (or, for a fixed strategy, its best ZeRO stage and shares)."""
    if case.fixed:
        options = StrategyOptions(zero=1, sequence_parallel=True, dtype="bf16")
        stages = (kw["zero"],) if kw.get("zero") else (1, 2, 3)
        found = fastest_fitting(
            zero_predictions(parse_strategy(case.fixed), config, cost, seq_len=case.seq,
                             options=options, stages=stages,
                             uneven=kw.get("uneven_shares", True)),
            cost,
        )  # fmt: skip
        assert found is not None, case
        return found
    ranks = parse_ranks(case.ranks) if case.ranks else None
    return plan(config, cost, global_batch=case.batch, seq_len=case.seq, homogeneous=False,
                ranks=ranks, min_pipelines=2 if ranks else 1, **kw).prediction  # fmt: skip


def run_case(case: Case) -> dict[str, Any]:
    config = get_config(case.model)
    cost = CostModel.of(load_cluster(case.cluster))
    began = time.perf_counter()
    ours = _ours(case, config, cost)
    even = _ours(case, config, cost, uneven_shares=False)
    zero1 = _ours(case, config, cost, zero=1, uneven_shares=False)
    zero1_shares = _ours(case, config, cost, zero=1)
    seconds = time.perf_counter() - began
    kept = case.deepspeed_ranks or case.ranks
    pool = parse_ranks(kept) if kept else None
    paper = (
        predict_deepspeed(parse_deepspeed(case.deepspeed), config, cost, global_batch=case.batch,
                          seq_len=case.seq, ranks=pool)
        if case.deepspeed else None
    )  # fmt: skip
    best = best_deepspeed(config, cost, global_batch=case.batch, seq_len=case.seq, ranks=pool)
    t = ours.step_time_s
    return {
        "case": case.name, "ours_s": t, "zero": ours.options.zero,
        "zero_shares": list(ours.options.zero_shares), "recompute": ours.options.recompute,
        "even_s": even.step_time_s, "even_zero": even.options.zero,
        "zero1_s": zero1.step_time_s, "zero1_shares_s": zero1_shares.step_time_s,
        "zero1_shares": list(zero1_shares.options.zero_shares),
        "ds_paper": case.deepspeed, "ds_paper_s": paper.step_time_s if paper else None,
        "ds_paper_fits": paper.fits if paper else None,
        "ds_best": str(best[0]) if best else None, "ds_best_s": best[1].step_time_s if best else None,
        "vs_even": even.step_time_s / t, "vs_zero1": zero1.step_time_s / t,
        "vs_ds_paper": paper.step_time_s / t if paper else None,
        "vs_ds_best": best[1].step_time_s / t if best else None,
        "strategy": str(ours.strategy), "plan_seconds": seconds,
    }  # fmt: skip


def _cell(x: float | None, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{digits}f}"


def report(rows: list[dict[str, Any]]) -> None:
    print("Sharded states in simulation: step time (s) and ratios other / ours")
    print(f"{'case':<13}{'ours':>7}{'ZeRO':>5}{'shares':>14}{'even':>7}{'ZeRO-1':>7}{'Z1+sh':>7}"
          f"{'Z1 shares':>11}{'DS paper':>9}{'DS best':>8}{'x even':>7}{'x Z1':>6}{'x DSp':>6}{'x DSb':>6}")  # fmt: skip
    for r in rows:
        shares = ",".join(f"{w:g}" for w in r["zero_shares"]) or "even"
        z1 = ",".join(f"{w:g}" for w in r["zero1_shares"]) or "even"
        fits = "" if r["ds_paper_fits"] in (None, True) else "!"
        print(f"{r['case']:<13}{r['ours_s']:7.2f}{r['zero']:>5}{shares:>14}{r['even_s']:7.2f}"
              f"{r['zero1_s']:7.2f}{r['zero1_shares_s']:7.2f}{z1:>11}{_cell(r['ds_paper_s'], 8)}{fits:1}{_cell(r['ds_best_s'], 8)}"
              f"{r['vs_even']:7.3f}{r['vs_zero1']:6.3f}{_cell(r['vs_ds_paper'], 6)}"
              f"{_cell(r['vs_ds_best'], 6)}")  # fmt: skip
    for r in rows:
        ds = f"; DeepSpeed best {r['ds_best']}" if r["ds_best"] else ""
        print(f"  {r['case']}: {r['strategy']}{ds} (planned 4 ways in {r['plan_seconds']:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also the rest of Table 8")
    args = parser.parse_args()
    rows = [run_case(c) for c in CASES + (MORE if args.all else ())]
    report(rows)
    ratios = {
        r["case"]: {k: round(r[k], 4) for k in ("vs_even", "vs_zero1", "vs_ds_paper", "vs_ds_best")
                    if r[k] is not None}
        for r in rows
    }  # fmt: skip
    print(json.dumps({"benchmark": "zero_plans", "ratios": ratios, "rows": rows}))


if __name__ == "__main__":
    main()
