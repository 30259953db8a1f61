"""Figure 16 of the HSPMD paper in simulation: the elastic trace C1 -> C7, side by side.

llama-32b, global batch 64, sequence 4096, bf16, on the shipped ``hetu-h800-h20`` cluster
(2 nodes of 8 H800, ranks 0-15; 4 nodes of 8 H20, ranks 16-47). The trace of the paper's
Tables 10-12 (section 9 (b), Appendix C.3):

    config  alive GPUs            event that leads to it
    C1      32 H20  (R16-47)      start
    C2      31 H20  (R16-46)      GPU failure (R47, the paper's R31)
    C3      24 H20  (R16-39)      the failed GPU's node leaves
    C4      16 H800 + 32 H20      growth: 16 H800 and 8 H20 join
    C5      16 H800 + 24 H20      an H20 node leaves (R40-47)
    C6      15 H800 + 24 H20      GPU failure (R15)
    C7      8 H800 + 24 H20       the failed GPU's node leaves (R8-15)

Per configuration, every step time from the same simulator (``hspmd.planner.predict``):

- **ours**: ``hspmd.planner.elastic.replan`` over the alive GPUs, warm-started from the
  previous configuration's plan (two pipelines or more, ZeRO-1 off);
- **paper**: the paper's HSPMD plan of Tables 11-12 (ZeRO-1 off; recompute where our memory
  model says it does not fit without);
- **Megatron**: the paper's Table 10 Megatron plan (DP x TP x PP, even layers, ZeRO-1,
  Megatron's rank order) and **homog.**: our best homogeneous plan, both on the nodes
  Megatron keeps (it drops a failed GPU's whole node: C2 runs on C3's GPUs, C6 on C7's).
- **DeepSpeed**: the paper's Table 10 DeepSpeed plan (ZeRO-3 over every DP x SP rank,
  Ulysses SP, activation checkpointing; ``hspmd.planner.deepspeed``) on the same nodes.
  The best baseline is the fastest of the three that fits.

Reconfiguration overhead per change:

- ours: the measured ``replan`` seconds on this machine, plus ``--specialize-s`` (building
  the new executable graphs and process groups; default 7.05 s, the middle of the paper's
  Table 5 range 6.2-7.9 s: not measured here, there are no GPUs), plus the switch: the fused
  BSR of fp32 masters and Adam moments, predicted by ``hspmd.switch.cost`` (the paper
  measured 2.2-5.3 s);
- baselines (checkpoint and restart): ``--restart-s`` per change of their GPU set (none for
  C2 -> C3 and C6 -> C7: the node is already dropped). Its default is a model, not a
  measurement: ``RESTART_FIXED_S`` (60 s: relaunch 32-48 processes, CUDA and NCCL init,
  model build; assumed) plus saving and loading the model states (14 bytes a parameter:
  bf16 weights, fp32 masters, two Adam moments) at ``--storage-GBps`` (20 GB/s aggregate,
  assumed). Give the local measurement of the runtime benchmark (``hspmd train --elastic``
  against ``--resume``, scaled to this model as docs/elastic-planning.md says) instead;
  the table also prints the break-even restart cost above which our trace is faster.
- both: a failure loses the step in flight (half a step of the old configuration, on
  average); the baselines also lose ``--checkpoint-every / 2`` steps when it is not 0.

Each configuration runs ``--steps`` steps (the paper does not give its trace's lengths).
Ratios are baseline / ours.

    .venv/bin/python benchmarks/elastic.py --part sim
    .venv/bin/python benchmarks/elastic.py --part sim --restart-s 300 --steps 200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from hspmd.cost.cluster import Cluster, NodeGroup, load_cluster
from hspmd.cost.lines import CostModel
from hspmd.cost.stage import stage_params
from hspmd.models.config import LlamaConfig, get_config
from hspmd.plan.strategy import Strategy, StrategyOptions, format_ranks, parse_strategy
from hspmd.planner.deepspeed import parse_deepspeed, predict_deepspeed
from hspmd.planner.elastic import ElasticPlan, replan
from hspmd.planner.predict import Prediction, predict
from hspmd.planner.search import homogeneous_plan, megatron_strategy, plan

MODEL, BATCH, SEQ = "llama-32b", 64, 4096
H800, H20 = list(range(0, 16)), list(range(16, 48))
RESTART_FIXED_S = 60.0  # assumed: relaunch, CUDA/NCCL init, model build (not measured)
SPECIALIZE_S = 7.05  # the paper's Table 5: online graph specialization 6.2-7.9 s
STORAGE_GBPS = 20.0  # assumed aggregate checkpoint storage bandwidth


@dataclass(frozen=True)
class Config:
    name: str
    alive: tuple[int, ...]
    event: str  # "start", "failure", "leave", "grow"
    megatron_nodes: tuple[int, int]  # whole (H800, H20) nodes the baselines keep
    megatron: tuple[int, int, int, int]  # Table 10: DP, TP, PP, micro-batch size
    paper: str  # Tables 11-12, cluster rank ids
    deepspeed: str = ""  # Table 10: ZeRO-3, Ulysses SP, checkpointing (hspmd.planner.deepspeed)


def _h20(text: str) -> str:
    """Table 11 numbers the 32 H20 R0-31; here they are R16-47."""

    def shift(m: re.Match[str]) -> str:
        return "R" + re.sub(r"\d+", lambda n: str(int(n[0]) + 16), m[1])

    return re.sub(r"R([0-9,\-]+)", shift, text)


TRACE = (
    Config("C1", tuple(H20), "start", (0, 4), (2, 4, 4, 2), "16x2: " + _h20(
        "R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59") + "; 16x2: " + _h20(
        "R16-19:L0-14 R20-23:L15-29 R24-27:L30-44 R28-31:L45-59")),
    Config("C2", tuple(H20[:-1]), "failure", (0, 3), (1, 4, 6, 1), "33x1: " + _h20(
        "R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59") + "; 31x1: " + _h20(
        "R16-19:L0-15 R20-23:L16-31 R24-27:L32-47 R28-29:L48-55 R30:L56-59")),
    Config("C3", tuple(H20[:24]), "leave", (0, 3), (1, 4, 6, 1), "32x1: " + _h20(
        "R0-3:L0-19 R4-7:L20-39 R8-11:L40-59") + "; 32x1: " + _h20(
        "R12-15:L0-19 R16-19:L20-39 R20-23:L40-59")),
    Config("C4", tuple(H800 + H20), "grow", (2, 4), (4, 4, 3, 2),
           "32x1: R16-19:L0-4 R20-23:L5-10 R24-27:L11-16 R28-31:L17-22 R0-3:L23-40 "
           "R4-7:L41-59; 32x1: R32-35:L0-4 R36-39:L5-10 R40-43:L11-16 R44-47:L17-22 "
           "R8-11:L23-40 R12-15:L41-59"),
    Config("C5", tuple(H800 + H20[:24]), "leave", (2, 3), (1, 8, 5, 1),
           "32x1: R16-19:L0-5 R20-23:L6-11 R24-27:L12-17 R0-3:L18-38 R4-7:L39-59; "
           "32x1: R28-31:L0-5 R32-35:L6-11 R36-39:L12-17 R8-11:L18-38 R12-15:L39-59"),
    Config("C6", tuple(H800[:15] + H20[:24]), "failure", (1, 3), (2, 4, 4, 2),
           "33x1: R16-19:L0-5 R20-23:L6-11 R24-27:L12-17 R0-3:L18-38 R4-7:L39-59; "
           "31x1: R28-31:L0-5 R32-35:L6-11 R36-39:L12-17 R8-11:L18-39 R12-13:L40-52 "
           "R14:L53-59"),
    Config("C7", tuple(H800[:8] + H20[:24]), "leave", (1, 3), (2, 4, 4, 2),
           "32x1: R16-19:L0-8 R20-23:L9-18 R24-27:L19-28 R0-3:L29-59; "
           "32x1: R28-31:L0-8 R32-35:L9-18 R36-39:L19-28 R4-7:L29-59"),
)  # fmt: skip
DEEPSPEED = {  # Table 10's DeepSpeed column, on the whole nodes Megatron keeps too
    "C1": "DP16SP2AC, bs2", "C2": "DP12SP2AC, bs2", "C3": "DP12SP2AC, bs2",
    "C4": "DP24SP2AC, bs1", "C5": "DP20SP2AC, bs2", "C6": "DP16SP2AC, bs2",
    "C7": "DP16SP2AC, bs2",
}  # fmt: skip
TRACE = tuple(dataclasses.replace(c, deepspeed=DEEPSPEED[c.name]) for c in TRACE)


def _fitting(
    strategy: Strategy, config: LlamaConfig, cost: CostModel, *, zero1: bool
) -> Prediction:
    """The prediction with recompute off, or on where off does not fit."""
    for recompute in (False, True):
        opts = StrategyOptions(
            zero=int(zero1), sequence_parallel=True, dtype="bf16", recompute=recompute
        )
        p = predict(strategy, config, cost, seq_len=SEQ, options=opts)
        if p.fits:
            return p
    return p


def _kept_cluster(full: Cluster, nodes: tuple[int, int]) -> Cluster:
    """The whole nodes a baseline keeps, H800 first (ranks renumbered from 0)."""
    groups = tuple(
        NodeGroup(kind, count, 8) for kind, count in zip(("H800", "H20"), nodes, strict=True)
        if count
    )  # fmt: skip
    return dataclasses.replace(full, name=f"{full.name}-{nodes[0]}x8+{nodes[1]}x8", groups=groups)


def _baselines(full: Cluster, c: Config, config: LlamaConfig) -> dict[str, Any]:
    cost = CostModel.of(_kept_cluster(full, c.megatron_nodes))
    dp, tp, pp, mbs = c.megatron
    mega = megatron_strategy(
        dp, tp, pp, config.num_layers, BATCH // (dp * mbs), mbs, pipeline_major=False
    )
    m = _fitting(mega, config, cost, zero1=dp > 1)
    h = homogeneous_plan(config, cost, global_batch=BATCH, seq_len=SEQ)
    ds = predict_deepspeed(parse_deepspeed(c.deepspeed), config, cost, global_batch=BATCH,
                           seq_len=SEQ)  # fmt: skip
    return {
        "baseline_gpus": cost.num_ranks,
        "megatron_s": m.step_time_s,
        "megatron_fits": m.fits,
        "megatron_recompute": m.options.recompute,
        "deepspeed_s": ds.step_time_s,
        "deepspeed_fits": ds.fits,
        "homogeneous_s": h.step_time_s if h else math.inf,
        "homogeneous": str(h.strategy) if h else None,
    }


def restart_default(config: LlamaConfig, storage_gbps: float) -> float:
    """``RESTART_FIXED_S`` plus saving and loading 14 bytes a parameter."""
    params = stage_params(config, config.num_layers, 1, first=True, last=True)
    return RESTART_FIXED_S + 2 * 14 * params / (storage_gbps * 1e9)


def sim_part(args: argparse.Namespace) -> dict[str, Any]:
    config = get_config(MODEL)
    full = load_cluster("hetu-h800-h20")
    cost = CostModel.of(full)
    restart = args.restart_s if args.restart_s is not None else restart_default(
        config, args.storage_GBps
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    current: ElasticPlan | None = None
    prev_base: dict[str, Any] | None = None
    for c in TRACE:
        ours = replan(
            config, cost, alive=c.alive, current=current.strategy if current else None,
            global_batch=BATCH, seq_len=SEQ,
        )  # fmt: skip
        paper = _fitting(parse_strategy(c.paper), config, cost, zero1=False)
        base = _baselines(full, c, config)
        ds = base["deepspeed_s"] if base["deepspeed_fits"] else math.inf
        best_base = min(base["megatron_s"], base["homogeneous_s"], ds)
        row: dict[str, Any] = {
            "config": c.name, "event": c.event, "alive": format_ranks(c.alive),
            "gpus": len(c.alive), "ours_s": ours.step_time_s, "paper_plan_s": paper.step_time_s,
            "paper_plan_recompute": paper.options.recompute, **base,
            "best_baseline_s": best_base, "strategy": str(ours.strategy),
            "unused_ranks": list(ours.unused_ranks), "source": ours.source,
            "plan_seconds": ours.plan_seconds,
        }  # fmt: skip
        if current is None:  # the first plan is made before training: no reconfiguration
            row |= {"ours_overhead_s": 0.0, "switch_s": 0.0, "moved_GB": 0.0, "lost_step_s": 0.0}
            row |= {"baseline_overhead_s": 0.0}
        else:
            switch = ours.switch.seconds if ours.switch else math.nan
            moved = ours.moved_bytes / 1e9 if ours.moved_bytes is not None else math.nan
            lost = 0.5 * rows[-1]["ours_s"] if c.event == "failure" else 0.0
            row |= {
                "switch_s": switch, "moved_GB": moved, "lost_step_s": lost,
                "ours_overhead_s": ours.plan_seconds + args.specialize_s + switch + lost,
            }  # fmt: skip
            assert prev_base is not None
            same_gpus = base["baseline_gpus"] == prev_base["baseline_gpus"] and c.event == "leave"
            base_lost = 0.0
            if c.event == "failure":
                steps = args.checkpoint_every / 2 if args.checkpoint_every else 0.5
                base_lost = steps * rows[-1]["best_baseline_s"]
            row["baseline_overhead_s"] = (0.0 if same_gpus else restart) + base_lost
        rows.append(row)
        current, prev_base = ours, base
    free = min(  # no redundancy asked: one pipeline allowed, ZeRO-1 on (auto) or off
        plan(config, cost, global_batch=BATCH, seq_len=SEQ, zero1=z, homogeneous=False)
        .step_time_s
        for z in ("auto", "off")
    )  # fmt: skip
    # our C4 plan is a candidate of the unconstrained search too (its pruning may miss it)
    c4 = next(r for r in rows if r["config"] == "C4")
    return _report(rows, args, restart, min(free, c4["ours_s"]), free)


def _report(
    rows: list[dict[str, Any]], args: argparse.Namespace, restart: float, free_c4: float,
    searched_c4: float,
) -> dict[str, Any]:  # fmt: skip
    steps = args.steps
    ours_total = sum(r["ours_s"] * steps + r["ours_overhead_s"] for r in rows)
    base_total = sum(r["best_baseline_s"] * steps + r["baseline_overhead_s"] for r in rows)
    restarts = sum(1 for r in rows if r["baseline_overhead_s"] >= restart > 0)
    base_no_restart = base_total - restarts * restart
    break_even = (ours_total - base_no_restart) / restarts if restarts else math.nan
    print(f"Figure 16 in simulation: {MODEL}, global batch {BATCH}, seq {SEQ}, {steps} steps "
          f"per configuration; step times (s), ratios baseline / ours")  # fmt: skip
    head = (f"{'cfg':<4}{'GPUs':>5}{'base':>5}{'ours':>7}{'paper':>7}{'Megatr.':>8}{'DeepSp.':>8}"
            f"{'homog.':>7}{'x Meg':>6}{'x DS':>6}{'x base':>7}{'plan s':>7}{'switch':>7}{'GB':>6}{'ovh ours':>9}{'ovh base':>9}")  # fmt: skip
    print(head)
    for r in rows:
        mega = f"{r['megatron_s']:.2f}" + ("" if r["megatron_fits"] else "!") + (
            "r" if r["megatron_recompute"] else ""
        )  # fmt: skip
        paper = f"{r['paper_plan_s']:.2f}" + ("r" if r["paper_plan_recompute"] else "")
        ds = f"{r['deepspeed_s']:.2f}" + ("" if r["deepspeed_fits"] else "!")
        print(f"{r['config']:<4}{r['gpus']:>5}{r['baseline_gpus']:>5}{r['ours_s']:7.2f}{paper:>7}{mega:>8}"
              f"{ds:>8}{r['homogeneous_s']:7.2f}{r['megatron_s'] / r['ours_s']:6.2f}"
              f"{r['deepspeed_s'] / r['ours_s']:6.2f}{r['best_baseline_s'] / r['ours_s']:7.2f}"
              f"{r['plan_seconds']:7.2f}{r['switch_s']:7.2f}{r['moved_GB']:6.0f}"
              f"{r['ours_overhead_s']:9.1f}{r['baseline_overhead_s']:9.1f}")  # fmt: skip
    print(
        "  r: recompute (no fit without); !: does not fit even with it. base: the GPUs Megatron, "
        "DeepSpeed and homog. run on (whole nodes: C2 on C3's 24 H20, C6 on C7's 8 H800 + 24 "
        "H20); DeepSp.: Table 10's ZeRO-3 + Ulysses SP + checkpointing plan"
    )
    print(
        f"  ours: plan + {args.specialize_s:g} s specialization (assumed, paper Table 5) + "
        f"predicted fused BSR + half a step per failure; baselines: restart {restart:.0f} s "
        f"{'(--restart-s)' if args.restart_s is not None else '(default model, assumed)'}"
    )
    c4 = next(r for r in rows if r["config"] == "C4")
    print(
        f"C4: ours {c4['ours_s']:.2f} s with two replicas and ZeRO-1 off, {free_c4:.2f} s for "
        f"the best plan without redundancy (one pipeline and ZeRO-1 allowed; that search "
        f"alone finds {searched_c4:.2f} s): redundancy costs "
        f"{c4['ours_s'] / free_c4 - 1:+.0%}; paper: 6.91 s vs 6.05 s (+14%). Best baseline "
        f"{c4['best_baseline_s']:.2f} s ({c4['best_baseline_s'] / c4['ours_s']:.2f}x ours)"
    )
    even = (f"for any restart cost above {break_even:.0f} s" if break_even > 0
            else "even if a restart cost nothing")  # fmt: skip
    print(
        f"trace total: ours {ours_total:.0f} s, best baseline {base_total:.0f} s "
        f"({base_total / ours_total:.2f}x); ours is faster {even}"
    )
    for r in rows:
        print(f"  {r['config']} ({r['source']}): {r['strategy']}")
    return {
        "steps_per_config": steps, "restart_s": restart, "specialize_s": args.specialize_s,
        "ours_total_s": ours_total, "baseline_total_s": base_total,
        "total_ratio": base_total / ours_total, "break_even_restart_s": break_even,
        "c4": {"ours_s": c4["ours_s"], "unconstrained_s": free_c4, "unconstrained_search_s": searched_c4,
               "best_baseline_s": c4["best_baseline_s"], "paper_ours_s": 6.91,
               "paper_unconstrained_s": 6.05},
        "configs": rows,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("sim",), default="sim")
    parser.add_argument("--steps", type=int, default=50, help="steps per configuration")
    parser.add_argument(
        "--restart-s", type=float, default=None,
        help="baseline checkpoint-and-restart seconds (default: RESTART_FIXED_S plus saving "
        "and loading the states at --storage-GBps)",
    )  # fmt: skip
    parser.add_argument("--storage-GBps", type=float, default=STORAGE_GBPS)
    parser.add_argument("--specialize-s", type=float, default=SPECIALIZE_S)
    parser.add_argument(
        "--checkpoint-every", type=int, default=0,
        help="baseline checkpoint interval in steps (0: one right before each failure)",
    )  # fmt: skip
    args = parser.parse_args()
    result = {"benchmark": "elastic", "sim": sim_part(args)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
