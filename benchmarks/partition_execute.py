"""Measured against predicted speedup of a ParDNN placement on local gloo ranks.

The model is :class:`hspmd.partition.timing.BranchNet` (an inception-style block:
parallel MLP towers summed into a head). One process runs the plain module's step
(forward + backward, one thread); the op graph gets measured node times (median of
repeated interpreter runs, scaled to that step); ParDNN places it on ``--ranks``
processes (gloo, one thread each), and the placed step is timed there. The emulator's
prediction uses the same node times and the link fitted by a ping-pong in the run.

    PYTHONPATH=src .venv/bin/python benchmarks/partition_execute.py            # 2 ranks
    PYTHONPATH=src .venv/bin/python benchmarks/partition_execute.py --width 512 --steps 20

Prints a table, then one JSON line with ``measured_speedup`` (medians),
``measured_speedup_fastest_steps`` (fastest step of each) and ``predicted_speedup``.
On a machine whose cores are shared with other jobs the measured figure is noisy: the
ranks only overlap if two cores are free at once.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from hspmd.partition import baselines
from hspmd.partition.emulate import CommModel, emulate
from hspmd.partition.execute import RunSpec, plan_from_placement
from hspmd.partition.pardnn import partition
from hspmd.partition.timing import BranchNet, measured_graph, time_plan, time_single

# a guess for local gloo used to place (the fitted link judges the placement afterwards)
PRIOR = CommModel(latency_us=100.0, bytes_per_us=1000.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after a warm-up)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    make = functools.partial(BranchNet, width=args.width, branches=args.branches, depth=args.depth)
    gen = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(args.batch, args.width, generator=gen),
        torch.randint(0, 8, (args.batch,), generator=gen),
    )
    single_s = time_single(make, F.cross_entropy, batch, steps=args.steps)
    single = float(np.median(single_s))
    traced, graph = measured_graph(make, F.cross_entropy, batch, step_seconds=single)
    place = partition(graph, num_devices=args.ranks, comm=PRIOR).placement
    plan = plan_from_placement(traced, graph, place, num_ranks=args.ranks)
    placed = time_plan(RunSpec(make, F.cross_entropy, batch, plan), steps=args.steps)
    placed_s = float(np.median(placed.step_seconds))
    # the same interpreter and launcher on one rank: what the machinery costs by itself
    alone_plan = plan_from_placement(traced, graph, baselines.single_device(graph), num_ranks=1)
    alone = time_plan(RunSpec(make, F.cross_entropy, batch, alone_plan), steps=args.steps)
    alone_s = float(np.median(alone.step_seconds))
    link = placed.link
    one = emulate(graph, baselines.single_device(graph), comm=link).makespan_us
    many = emulate(graph, place, comm=link).makespan_us
    many_prior = emulate(graph, place, comm=PRIOR).makespan_us
    table = Table(title=f"BranchNet {args.branches}x{args.depth}x{args.width}, batch {args.batch}")
    for col in ("run", "step ms (median)", "min", "max", "speedup"):
        table.add_column(col, justify="left" if col == "run" else "right")
    table.add_row(
        "1 process",
        f"{single * 1e3:.1f}",
        f"{min(single_s) * 1e3:.1f}",
        f"{max(single_s) * 1e3:.1f}",
        "1.00",
    )
    table.add_row(
        f"placed, {args.ranks} gloo ranks",
        f"{placed_s * 1e3:.1f}",
        f"{min(placed.step_seconds) * 1e3:.1f}",
        f"{max(placed.step_seconds) * 1e3:.1f}",
        f"{single / placed_s:.2f}",
    )
    table.add_row(
        "all nodes on 1 gloo rank",
        f"{alone_s * 1e3:.1f}",
        f"{min(alone.step_seconds) * 1e3:.1f}",
        f"{max(alone.step_seconds) * 1e3:.1f}",
        f"{single / alone_s:.2f}",
    )
    table.add_row("emulator, fitted link", f"{many / 1e3:.1f}", "", "", f"{one / many:.2f}")
    console = Console(width=120)
    console.print(table)
    console.print(
        f"{len(plan.transfers)} transfers; link fitted by ping-pong: {link}; "
        f"ops per rank {np.bincount(place, minlength=args.ranks).tolist()}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    summary = {
        "model": f"BranchNet(width={args.width}, branches={args.branches}, depth={args.depth})",
        "batch": args.batch,
        "ranks": args.ranks,
        "steps": args.steps,
        "single_step_ms": round(single * 1e3, 2),
        "placed_step_ms": round(placed_s * 1e3, 2),
        "one_rank_step_ms": round(alone_s * 1e3, 2),
        "measured_speedup_over_one_rank": round(alone_s / placed_s, 3),
        "measured_speedup": round(single / placed_s, 3),
        "measured_speedup_fastest_steps": round(min(single_s) / min(placed.step_seconds), 3),
        "predicted_speedup": round(one / many, 3),
        "predicted_speedup_prior_link": round(one / many_prior, 3),
        "link_latency_us": round(link.latency_us, 1),
        "link_bytes_per_us": round(link.bytes_per_us, 1),
        "transfers": len(plan.transfers),
        "load_average": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
