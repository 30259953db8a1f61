"""The planner and the simulator, side by side in one run.

Part ``paper`` (simulation only, seconds): the paper's scenario (a), llama-32b and
llama-70b, global batch 64, sequence 4096, on 16 H800 with 16, 24 and 32 H20 (the shipped
cluster files hetu-h800-h20x16, -h20x24, hetu-h800-h20; their ``assumed`` entries list
what is not in the paper). Each row simulates, with the same simulator: our plan, the
paper's Table 9 plan (ZeRO-1, sequence parallel assumed), the paper's Table 8 Megatron
plan (DP x TP x PP, even layers, Megatron rank order), its Table 8 DeepSpeed plan (ZeRO-3
over DP x SP, Ulysses SP, activation checkpointing: ``hspmd.planner.deepspeed``) and our
best homogeneous plan; and the planning time. Our plan's ZeRO stage and shares are the
planner's choice (docs/zero.md). Then planning time on 4096 ranks.

Part ``local`` (real processes, minutes): ``hspmd profile`` on this machine, then
llama-small on 4 local processes: predicted against measured step time for six
strategies (DP, TP, PP, uneven PP, different TP per pipeline, different micro-batch
counts), and on a fake cluster whose ranks 2 and 3 run 3x slower (``--slowdown``), the
planner's plan against the best homogeneous plan, measured.

The local cluster file names the profile taken in the same run (one-thread compute, as
each of the 4 ranks gets on this machine, and its ``core_sharing``: k one-thread processes
computing at once against one alone); the simulator slows each compute task by the factor
of the number of ranks computing at that moment, and every link is the measured
"loopback". Each strategy is measured over ``--repeats`` launches (median step time).

    .venv/bin/python benchmarks/planner.py                 # both parts
    .venv/bin/python benchmarks/planner.py --part paper    # simulation only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.config import get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.planner.deepspeed import parse_deepspeed, predict_deepspeed
from hspmd.planner.predict import predict
from hspmd.planner.search import homogeneous_plan, megatron_strategy, plan
from hspmd.train.api import train_config

CLUSTERS = {"16+16": "hetu-h800-h20x16", "16+24": "hetu-h800-h20x24", "16+32": "hetu-h800-h20"}

TABLE9 = {  # the paper's Table 9 (HSPMD's plans), ZeRO-1 on
    ("llama-32b", "16+16"): "32x1: R16-19:L0-6 R20-23:L7-13 R0-3:L14-36 R4-7:L37-59; "
    "32x1: R24-27:L0-6 R28-31:L7-13 R8-11:L14-36 R12-15:L37-59",
    ("llama-32b", "16+24"): "32x1: R16-19:L0-5 R20-23:L6-11 R24-27:L12-17 R0-3:L18-38 "
    "R4-7:L39-59; 32x1: R28-31:L0-5 R32-35:L6-11 R36-39:L12-17 R8-11:L18-38 R12-15:L39-59",
    ("llama-32b", "16+32"): "; ".join(
        f"16x1: R{16 + 8 * i}-{19 + 8 * i}:L0-10 R{20 + 8 * i}-{23 + 8 * i}:L11-21 "
        f"R{4 * i}-{4 * i + 3}:L22-59"
        for i in range(4)
    ),
    ("llama-70b", "16+16"): "64x1: R16-23:L0-10 R24-31:L11-21 R0-7:L22-50 R8-15:L51-79",
    ("llama-70b", "16+24"): "64x1: R16-23:L0-9 R24-31:L10-19 R32-39:L20-29 R0-7:L30-54 "
    "R8-15:L55-79",
    ("llama-70b", "16+32"): "32x1: R16-23:L0-16 R24-31:L17-33 R0-7:L34-79; "
    "32x1: R32-39:L0-16 R40-47:L17-33 R8-15:L34-79",
}
TABLE8 = {  # the paper's Table 8 (Megatron): (DP, TP, PP, micro-batch size)
    ("llama-32b", "16+16"): (2, 4, 4, 2),
    ("llama-32b", "16+24"): (2, 4, 5, 2),
    ("llama-32b", "16+32"): (4, 4, 3, 2),
    ("llama-70b", "16+16"): (1, 8, 4, 1),
    ("llama-70b", "16+24"): (1, 8, 5, 1),
    ("llama-70b", "16+32"): (1, 8, 6, 1),
}


TABLE8_DEEPSPEED = {  # the paper's Table 8 (DeepSpeed: ZeRO-3, Ulysses SP, checkpointing)
    ("llama-32b", "16+16"): "DP16SP2AC, bs2",
    ("llama-32b", "16+24"): "DP20SP2AC, bs4",
    ("llama-32b", "16+32"): "DP24SP2AC, bs1",
    ("llama-70b", "16+16"): "DP16SP2AC, bs1",
    ("llama-70b", "16+24"): "DP20SP2AC, bs2",
    ("llama-70b", "16+32"): "DP24SP2AC, bs1",
}


def paper_part() -> dict[str, Any]:
    rows, out = [], {}
    for model in ("llama-32b", "llama-70b"):
        config = get_config(model)
        for name, cluster in CLUSTERS.items():
            cost = CostModel.of(load_cluster(cluster))
            began = time.perf_counter()
            ours = plan(config, cost, global_batch=64, seq_len=4096, homogeneous=False)
            planning = time.perf_counter() - began
            base = homogeneous_plan(config, cost, global_batch=64, seq_len=4096)
            opts = StrategyOptions(zero=1, sequence_parallel=True, dtype="bf16")
            t9 = predict(
                parse_strategy(TABLE9[model, name]), config, cost, seq_len=4096, options=opts
            )
            dp, tp, pp, mbs = TABLE8[model, name]
            t8s = megatron_strategy(
                dp, tp, pp, config.num_layers, 64 // (dp * mbs), mbs, pipeline_major=False
            )
            t8o = StrategyOptions(zero=int(dp > 1), sequence_parallel=True, dtype="bf16")
            t8 = predict(t8s, config, cost, seq_len=4096, options=t8o)
            ds = predict_deepspeed(parse_deepspeed(TABLE8_DEEPSPEED[model, name]), config, cost,
                                   global_batch=64, seq_len=4096)  # fmt: skip
            h = base.step_time_s if base else float("nan")
            row = {
                "ours_s": ours.step_time_s, "table9_s": t9.step_time_s,
                "table9_fits": t9.fits, "table8_s": t8.step_time_s, "table8_fits": t8.fits,
                "deepspeed_s": ds.step_time_s, "deepspeed_fits": ds.fits,
                "vs_deepspeed": ds.step_time_s / ours.step_time_s,
                "homogeneous_s": h, "plan_seconds": planning, "zero": ours.options.zero,
                "zero_shares": list(ours.options.zero_shares),
                "vs_table9": t9.step_time_s / ours.step_time_s,
                "vs_homogeneous": h / ours.step_time_s, "vs_table8": t8.step_time_s / ours.step_time_s,
                "strategy": str(ours.strategy), "homogeneous": str(base.strategy) if base else None,
            }  # fmt: skip
            out[f"{model} {name}"] = row
            rows.append((model, name, row))
    print("scenario (a), simulated step time in seconds (ratios: other / ours)")
    print("  Table 8: Megatron (DP x TP x PP, ZeRO-1); DeepSpeed (ZeRO-3 over DP x SP, Ulysses "
          "SP, checkpointing; hspmd.planner.deepspeed); !: over memory")  # fmt: skip
    print(f"{'model':<10}{'H800+H20':<9}{'ours':>7}{'Table 9':>9}{'T8 Meg.':>9}{'T8 DS':>8}"
          f"{'homog.':>8}{'x T9':>6}{'x Meg':>6}{'x DS':>6}{'x hom':>7}{'plan s':>8}")  # fmt: skip
    for model, name, r in rows:
        ds = f"{r['deepspeed_s']:.2f}" + ("" if r["deepspeed_fits"] else "!")
        print(f"{model:<10}{name:<9}{r['ours_s']:7.2f}{r['table9_s']:9.2f}{r['table8_s']:9.2f}"
              f"{ds:>8}{r['homogeneous_s']:8.2f}{r['vs_table9']:6.2f}{r['vs_table8']:6.2f}"
              f"{r['vs_deepspeed']:6.2f}{r['vs_homogeneous']:7.2f}{r['plan_seconds']:8.2f}")  # fmt: skip
    for model, name, r in rows:
        shares = f" zero_shares={r['zero_shares']}" if r["zero_shares"] else ""
        print(f"  {model} {name}: ZeRO {r['zero']}{shares}: {r['strategy']}")
    return out


def big_part() -> dict[str, Any]:
    """Planning time on 4096 ranks: 256 nodes of 8, half H800, half H20 (paper's kinds)."""
    shipped = resources.files("hspmd") / "clusters" / "hetu-h800-h20.json"
    data = json.loads(shipped.read_text())
    data["name"] = "h800-h20-4096"
    data["nodes"] = [{"kind": "H800", "count": 256, "gpus_per_node": 8},
                     {"kind": "H20", "count": 256, "gpus_per_node": 8}]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.json"
        path.write_text(json.dumps(data))
        cost = CostModel.of(load_cluster(path))
        began = time.perf_counter()
        chosen = plan(get_config("llama-70b"), cost, global_batch=1024, seq_len=4096)
        seconds = time.perf_counter() - began
    h = chosen.homogeneous.step_time_s if chosen.homogeneous else float("nan")
    print(f"\n4096 ranks (2048 H800 + 2048 H20), llama-70b, global batch 1024: planned in "
          f"{seconds:.1f} s, step {chosen.step_time_s:.2f} s, homogeneous {h:.2f} s")  # fmt: skip
    return {"plan_seconds": seconds, "step_time_s": chosen.step_time_s, "homogeneous_s": h}


# -- local processes ---------------------------------------------------------------------------

LOCAL = {  # llama-small, 4 local processes
    "DP4": "2x1: R0:L0-7; 2x1: R1:L0-7; 2x1: R2:L0-7; 2x1: R3:L0-7",
    "TP4": "8x1: R0-3:L0-7",
    "PP4": "8x1: R0:L0-1 R1:L2-3 R2:L4-5 R3:L6-7",
    "PP2 uneven": "8x1: R0:L0-4 R1:L5-7",
    "TP2 | PP2": "4x1: R0-1:L0-7; 4x1: R2:L0-3 R3:L4-7",
    "6 + 2 micro-batches": "6x1: R0-1:L0-7; 2x1: R2-3:L0-7",
}
NPROC, SEQ, BATCH, STEPS, WARMUP, REPEATS = 4, 128, 8, 8, 2, 3


def local_cluster(path: Path, profile: Path, slowed: float) -> Path:
    """4 local ranks of the profiled kind (its ``core_sharing`` says how the processes
    slow each other down on this machine's cores); with ``slowed``, ranks 2 and 3 that much
    slower (a second kind on a second fake node; both nodes share this machine's cores:
    ``one_host``)."""
    kind = {"memory_mb": 4000, "bf16_tflops": 1, "profile": str(profile),
            "intra_link": {"name": "loopback", "GBps": 1}}  # fmt: skip
    kinds = {"cpu": kind}
    nodes = [{"kind": "cpu", "count": 1, "gpus_per_node": 4}]
    if slowed > 1:
        kinds["slow"] = dict(kind, slowdown=slowed)
        nodes = [{"kind": "cpu", "count": 1, "gpus_per_node": 2},
                 {"kind": "slow", "count": 1, "gpus_per_node": 2}]  # fmt: skip
    data = {"format": "hspmd.cluster/1", "name": path.stem, "gpu_kinds": kinds,
            "inter_link": {"name": "loopback", "GBps": 1}, "nodes": nodes, "one_host": True,
            "assumed": {"profile": f"hspmd profile of this machine ({os.cpu_count()} cores)"}}  # fmt: skip
    path.write_text(json.dumps(data))
    return path


def _measure(configs: list[Any], repeats: int) -> list[float]:
    """Each config's median step time over ``repeats`` launches (steps ``WARMUP + 1``.. of
    each: the first steps of a launch run slower, allocator and caches warming up)."""
    from hspmd.train.trainer import train_many

    times: list[list[float]] = [[] for _ in configs]
    for _ in range(repeats):
        for i, res in enumerate(train_many(configs)):
            times[i] += [r.seconds for r in res.records[WARMUP:]]
    return [statistics.median(t) for t in times]


def local_part(repeats: int = REPEATS, keep: str | None = None) -> dict[str, Any]:
    """``keep``: also write the profile taken to this file."""
    from hspmd.cost.measure import profile_machine

    config = get_config("llama-small")
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.json"
        # the full profile (about a minute): the quick one's few repetitions move its compute
        # lines by 10-20% from one run to the next on this shared machine
        profile.write_text(profile_machine(quick=False, nproc=NPROC, dtype="fp32").to_json())
        if keep:
            Path(keep).write_text(profile.read_text())
        plain = CostModel.of(
            load_cluster(local_cluster(Path(tmp) / "cpu4.json", profile, 1)), dtype="fp32"
        )
        slow = CostModel.of(
            load_cluster(local_cluster(Path(tmp) / "slow.json", profile, 3)), dtype="fp32"
        )
    out: dict[str, Any] = {"strategies": {}, "repeats": repeats}
    opts = StrategyOptions(dtype="fp32")
    texts = dict(LOCAL)
    predicted = {n: predict(parse_strategy(s), config, plain, seq_len=SEQ, options=opts).step_time_s
                 for n, s in texts.items()}  # fmt: skip
    ours = plan(config, slow, global_batch=BATCH, seq_len=SEQ, dtype="fp32", zero1="off")
    assert ours.homogeneous is not None
    planned = {"planner": ours, "homogeneous": ours.homogeneous}
    configs = [train_config(model="llama-small", strategy=s, global_batch=BATCH, seq_len=SEQ, steps=STEPS)
               for s in texts.values()]  # fmt: skip
    slow_ranks = ((2, 3.0), (3, 3.0))
    for p in planned.values():
        o = p.options
        configs.append(train_config(
            model="llama-small", strategy=str(p.strategy), global_batch=BATCH, seq_len=SEQ,
            steps=STEPS, sequence_parallel=o.sequence_parallel, recompute=o.recompute,
            slowdown=tuple(r for r in slow_ranks if r[0] in p.strategy.ranks),
        ))  # fmt: skip
    load = os.getloadavg()[0]
    measured = _measure(configs, repeats)
    out["load_before_after"] = [load, os.getloadavg()[0]]
    print(f"\nllama-small on {NPROC} local processes, batch {BATCH}, seq {SEQ}, fp32: "
          f"predicted vs measured step time (median of steps {WARMUP + 1}-{STEPS} over {repeats} launches; "
          f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after)")  # fmt: skip
    print(f"{'strategy':<22}{'predicted s':>12}{'measured s':>12}{'pred/meas':>10}")
    for (name, text), seconds in zip(texts.items(), measured, strict=False):
        ratio = predicted[name] / seconds
        out["strategies"][name] = {"strategy": text, "predicted_s": predicted[name],
                                   "measured_s": seconds, "ratio": ratio}  # fmt: skip
        print(f"{name:<22}{predicted[name]:12.3f}{seconds:12.3f}{ratio:10.2f}")
    plan_s, homog_s = measured[-2], measured[-1]
    print(f"\nranks 2, 3 slowed 3x: planner {ours.strategy}\n  predicted {ours.step_time_s:.3f} s, "
          f"measured {plan_s:.3f} s\nbest homogeneous {ours.homogeneous.strategy}\n  predicted "
          f"{ours.homogeneous.step_time_s:.3f} s, measured {homog_s:.3f} s\n"
          f"measured speedup {homog_s / plan_s:.2f}x (predicted "
          f"{ours.homogeneous.step_time_s / ours.step_time_s:.2f}x)")  # fmt: skip
    out["slowdown"] = {
        "planner": str(ours.strategy), "homogeneous": str(ours.homogeneous.strategy),
        "measured_speedup": homog_s / plan_s,
        "predicted_speedup": ours.homogeneous.step_time_s / ours.step_time_s,
        "order_predicted": (plan_s < homog_s) == (ours.step_time_s < ours.homogeneous.step_time_s),
    }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "paper", "local"), default="all")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="launches per strategy")
    parser.add_argument("--keep-profile", default=None, help="write the local profile here too")
    args = parser.parse_args()
    result: dict[str, Any] = {"benchmark": "planner"}
    if args.part in ("all", "paper"):
        result["paper"] = paper_part()
        result["4096"] = big_part()
    if args.part in ("all", "local"):
        result["local"] = local_part(args.repeats, args.keep_profile)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
