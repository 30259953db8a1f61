"""What tracing costs: step time with the recorder on vs off, side by side in one run.

For each strategy one launch of local gloo processes (llama-tiny, one thread per rank)
trains one config in which tracing is on in every other step (an ``Alternating`` recorder:
at each step's start it turns the recorder, and the runtime's ``world.tracer``, on or
off), so each traced step sits between two untraced ones and load from other processes on
the machine hits both sides alike. Step 1 (warm-up) is left out; steps 2, 3 form a pair,
then 4, 5, ... The overhead is the median over pairs of traced / untraced - 1, from the
step times rank 0 reports; the medians of each side are printed too. The goal is under 5%.

Beside the measured figure, an estimate that machine noise hardly touches: the events a
traced step records per rank, times what one event costs (timed here in a loop of a
million spans and comm steps), over the untraced step time.

    .venv/bin/python benchmarks/trace_overhead.py             # 4 strategies, a few minutes
    .venv/bin/python benchmarks/trace_overhead.py --quick     # 2 strategies, fewer steps

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from rich.console import Console
from rich.table import Table

from hspmd.plan.strategy import parse_strategy
from hspmd.runtime.launch import launch
from hspmd.runtime.trace import NULL, Recorder
from hspmd.runtime.world import World
from hspmd.train.api import train_config
from hspmd.train.config import TrainConfig
from hspmd.train.loop import run_rank

STRATEGIES = {
    "2-rank DP": "4x1: R0:L0-3; 4x1: R1:L0-3",
    "2-rank TP": "2x4: R0-1:L0-3",
    "4-stage 1F1B": "8x1: R0:L0 R1:L1 R2:L2 R3:L3",
    "TP2+PP2 | TP1": "2x2: R0-1:L0-1 R2:L2-3; 2x2: R3:L0-3",
}
QUICK = ("2-rank DP", "4-stage 1F1B")


class Alternating:
    """A recorder that records odd steps only (step 1 too: its warm-up is not measured)."""

    def __init__(self, world: World) -> None:
        self.world, self.rec, self.on = world, Recorder.start(world), False
        self.traced_steps = 0

    @property
    def enabled(self) -> bool:
        return self.on

    def span(self, name: str, *, cat: str, **args: Any) -> AbstractContextManager[None]:
        return (self.rec if self.on else NULL).span(name, cat=cat, **args)

    def begin(self, name: str, *, cat: str, **args: Any) -> Callable[[], None]:
        if cat == "step":  # run_rank opens each step with begin("step N", cat="step")
            self.on = args["step"] % 2 == 1
            self.world.tracer = self.rec if self.on else None
            self.traced_steps += self.on
        return (self.rec if self.on else NULL).begin(name, cat=cat, **args)


def _work(world: World, config: TrainConfig) -> dict[str, Any]:
    rec = Alternating(world)
    records = run_rank(world, config, rec=rec)["records"]
    inside = sum(1 for e in rec.rec.events if e[1] not in ("setup", "step"))
    return {
        "seconds": {r.step: r.seconds for r in records},
        "events_per_step": inside / max(rec.traced_steps, 1),
    }


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


def _row(name: str, strategy: str, *, steps: int, event_ns: float) -> dict[str, Any]:
    config = train_config(strategy=strategy, global_batch=8, seq_len=64, steps=steps)
    nproc = 1 + max(parse_strategy(strategy).ranks)
    per_rank = launch(_work, nproc, args=(config,), threads=1, timeout_s=1800)
    seconds = per_rank[0]["seconds"]
    # pairs (untraced step 2k, traced step 2k+1), k >= 1
    pairs = [(seconds[s], seconds[s + 1]) for s in range(2, steps, 2) if s + 1 in seconds]
    off = statistics.median(a for a, _ in pairs)
    on = statistics.median(b for _, b in pairs)
    events = max(r["events_per_step"] for r in per_rank)
    return {
        "name": name, "strategy": strategy, "ranks": nproc, "pairs": len(pairs),
        "off_s": off, "on_s": on,
        "overhead": statistics.median(b / a - 1 for a, b in pairs),
        "events_per_step": events, "estimated_overhead": events * event_ns * 1e-9 / off,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two strategies, fewer steps")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 41)")
    args = parser.parse_args()
    names = QUICK if args.quick else tuple(STRATEGIES)
    steps = args.steps or (13 if args.quick else 41)
    span_ns, comm_ns = _per_event_ns()
    rows = [_row(n, STRATEGIES[n], steps=steps, event_ns=max(span_ns, comm_ns)) for n in names]
    _print(rows, span_ns=span_ns, comm_ns=comm_ns)
    summary = {
        "benchmark": "trace_overhead",
        "ns_per_span": round(span_ns, 1),
        "ns_per_comm_step": round(comm_ns, 1),
        "steps": steps,
        "rows": rows,
        "max_overhead": max(r["overhead"] for r in rows),
        "max_estimated_overhead": max(r["estimated_overhead"] for r in rows),
    }
    print(json.dumps(summary))


def _print(rows: list[dict[str, Any]], *, span_ns: float, comm_ns: float) -> None:
    table = Table(title="tracing on vs off in alternate steps of one run (llama-tiny)")
    for column in ("strategy", "ranks", "pairs", "off ms", "on ms", "overhead", "events/step",
                   "estimate"):  # fmt: skip
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for r in rows:
        table.add_row(
            f"{r['name']}: {r['strategy']}", str(r["ranks"]), str(r["pairs"]),
            f"{r['off_s'] * 1e3:.1f}", f"{r['on_s'] * 1e3:.1f}", f"{r['overhead']:+.1%}",
            f"{r['events_per_step']:.0f}", f"{r['estimated_overhead']:.2%}",
        )  # fmt: skip
    console = Console(width=140)
    console.print(table)
    console.print(
        f"off/on: median step times; overhead: median over pairs of adjacent steps of "
        f"on / off - 1. One span costs {span_ns:.0f} ns, one comm step with its operation "
        f"{comm_ns:.0f} ns; estimate = events per traced step x the dearer / off"
    )


if __name__ == "__main__":
    main()
