"""What tracing costs: step time with the recorder on vs off, side by side in one run.

For each strategy one launch of local gloo processes (llama-tiny, one thread per rank) runs
the same training config ``--repeats`` times with tracing off and on, alternating which
goes first, so load on the machine hits both alike. A side's step time is the median over
its measured steps (every step but the first of each run), as rank 0 reports them. The
overhead is on / off - 1; the goal is under 5%.

Beside the measured figure, an estimate that no machine noise touches: the events a traced
step records per rank times what one event costs (timed here in a loop of a million spans
and comm steps) over the untraced step time.

    .venv/bin/python benchmarks/trace_overhead.py             # 4 strategies, a few minutes
    .venv/bin/python benchmarks/trace_overhead.py --quick     # 2 strategies, fewer steps

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from hspmd.plan.strategy import parse_strategy
from hspmd.runtime.launch import launch
from hspmd.runtime.trace import NULL, Recorder, Spans
from hspmd.runtime.world import World
from hspmd.train.config import TrainConfig
from hspmd.train.loop import run_rank

STRATEGIES = {
    "2-rank DP": "4x1: R0:L0-3; 4x1: R1:L0-3",
    "2-rank TP": "2x4: R0-1:L0-3",
    "4-stage 1F1B": "8x1: R0:L0 R1:L1 R2:L2 R3:L3",
    "TP2+PP2 | TP1": "2x2: R0-1:L0-1 R2:L2-3; 2x2: R3:L0-3",
}
QUICK = ("2-rank DP", "4-stage 1F1B")


def _work(world: World, config: TrainConfig, repeats: int) -> dict[str, list[float]]:
    """Alternate untraced and traced runs of ``config``; step seconds per side."""
    out: dict[str, list[float]] = {"off": [], "on": [], "events": []}
    for index in range(repeats):
        for mode in ("off", "on") if index % 2 == 0 else ("on", "off"):
            rec: Spans = Recorder.start(world) if mode == "on" else NULL
            result = run_rank(world, config, rec=rec)
            out[mode] += [r.seconds for r in result["records"][1:]]
            if isinstance(rec, Recorder):
                steps = [e for e in rec.events if e[1] == "step"]
                # events inside the timed steps, per step (setup and the clock sync excluded)
                inside = sum(1 for e in rec.events if e[1] not in ("setup", "step"))
                out["events"].append(inside / max(len(steps), 1))
    return out


def _per_event_ns(count: int = 1_000_000) -> tuple[float, float]:
    """ns per recorded span, and per comm step holding one operation."""
    rec = Recorder(0)
    begin = time.perf_counter_ns()
    for i in range(count):
        with rec.span("F", cat="forward", micro_batch=i, stage=0):
            pass
    span_ns = (time.perf_counter_ns() - begin) / count
    rec = Recorder(0)
    begin = time.perf_counter_ns()
    for _ in range(count):
        with rec.comm_step("all-reduce"):
            rec.op("all_reduce", (0, 1), 4096)
    comm_ns = (time.perf_counter_ns() - begin) / count
    return span_ns, comm_ns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two strategies, fewer steps")
    parser.add_argument("--repeats", type=int, default=None, help="runs per side (default 4)")
    args = parser.parse_args()
    names = QUICK if args.quick else tuple(STRATEGIES)
    repeats = args.repeats or (2 if args.quick else 4)
    steps = 4 if args.quick else 6
    span_ns, comm_ns = _per_event_ns()
    rows: list[dict[str, Any]] = []
    for name in names:
        strategy = STRATEGIES[name]
        config = TrainConfig(strategy=strategy, global_batch=8, seq_len=64, steps=steps)
        nproc = 1 + max(parse_strategy(strategy).ranks)
        per_rank = launch(_work, nproc, args=(config, repeats), threads=1, timeout_s=1800)
        off = statistics.median(per_rank[0]["off"])
        on = statistics.median(per_rank[0]["on"])
        events = max(statistics.median(r["events"]) for r in per_rank)
        estimate = events * max(span_ns, comm_ns) * 1e-9 / off
        rows.append({
            "name": name, "strategy": strategy, "ranks": nproc, "off_s": off, "on_s": on,
            "overhead": on / off - 1, "events_per_step": events, "estimated_overhead": estimate,
            "measured_steps": len(per_rank[0]["off"]),
        })  # fmt: skip
    _print(rows, span_ns=span_ns, comm_ns=comm_ns, repeats=repeats)
    summary = {
        "benchmark": "trace_overhead",
        "ns_per_span": round(span_ns, 1),
        "ns_per_comm_step": round(comm_ns, 1),
        "repeats": repeats,
        "rows": rows,
        "max_overhead": max(r["overhead"] for r in rows),
        "max_estimated_overhead": max(r["estimated_overhead"] for r in rows),
    }
    print(json.dumps(summary))


def _print(rows: list[dict[str, Any]], *, span_ns: float, comm_ns: float, repeats: int) -> None:
    table = Table(title=f"tracing on vs off (llama-tiny, median step of {repeats} runs per side)")
    for column in ("strategy", "ranks", "off ms", "on ms", "overhead", "events/step",
                   "estimate"):  # fmt: skip
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for r in rows:
        table.add_row(
            f"{r['name']}: {r['strategy']}", str(r["ranks"]), f"{r['off_s'] * 1e3:.1f}",
            f"{r['on_s'] * 1e3:.1f}", f"{r['overhead']:+.1%}", f"{r['events_per_step']:.0f}",
            f"{r['estimated_overhead']:.2%}",
        )  # fmt: skip
    console = Console(width=140)
    console.print(table)
    console.print(
        f"one span costs {span_ns:.0f} ns, one comm step with its operation {comm_ns:.0f} ns; "
        "estimate = events per step x the dearer of the two / untraced step time"
    )


if __name__ == "__main__":
    main()
