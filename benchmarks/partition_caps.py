"""ParDNN under memory caps: capped and uncapped placements side by side.

Graphs: generated transformer training steps (``hspmd.partition.transformer_graph``),
16 heads per layer ("wide": many parallel branches) and 1 head ("narrow": mostly a
chain), of about 10K to 200K ops; optionally the generated layered graphs. K devices
(default 4); each device is capped at ``--share`` (default 1.6) times its balanced share
of the single-device peak (``share * peak / K``). Every placement is judged by the same
FIFO emulator.

    .venv/bin/python benchmarks/partition_caps.py                      # 10K and 50K, both shapes
    .venv/bin/python benchmarks/partition_caps.py --sizes 100000 200000 --shapes narrow

Prints a table, then one JSON line: per graph, capped / uncapped makespan, both over the
single device, and the seconds of each partition.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

from hspmd.partition import baselines
from hspmd.partition.emulate import emulate
from hspmd.partition.generate import layered_graph
from hspmd.partition.graph import OpGraph
from hspmd.partition.pardnn import partition
from hspmd.partition.transformer_graph import TransformerShape, num_layers_for, transformer_graph

SHAPES = {"wide": TransformerShape(heads=16), "narrow": TransformerShape(heads=1)}


@dataclass(frozen=True, slots=True)
class CapRow:
    graph: str
    nodes: int
    devices: int
    single_us: float
    uncapped_us: float
    capped_us: float
    uncapped_seconds: float
    capped_seconds: float
    uncapped_peak_over_cap: float
    capped_peak_over_cap: float
    memory_seconds: float

    @property
    def ratio(self) -> float:
        return self.capped_us / self.uncapped_us


def run(graph: OpGraph, *, devices: int, share: float) -> CapRow:
    single = emulate(graph, baselines.single_device(graph))
    cap = int(share * int(single.peak_bytes.max()) / devices)
    begin = time.perf_counter()
    free = partition(graph, num_devices=devices)
    free_s = time.perf_counter() - begin
    begin = time.perf_counter()
    capped = partition(graph, num_devices=devices, memory_bytes=cap)
    capped_s = time.perf_counter() - begin
    return CapRow(
        graph=graph.name,
        nodes=graph.num_nodes,
        devices=devices,
        single_us=single.makespan_us,
        uncapped_us=free.emulation.makespan_us,
        capped_us=capped.emulation.makespan_us,
        uncapped_seconds=free_s,
        capped_seconds=capped_s,
        uncapped_peak_over_cap=float(free.emulation.peak_bytes.max()) / cap,
        capped_peak_over_cap=float(capped.emulation.peak_bytes.max()) / cap,
        memory_seconds=capped.phase_seconds.get("memory", 0.0),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", type=int, default=[10000, 50000], help="ops")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--layered", action="store_true", help="also the layered graphs")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--share", type=float, default=1.6, help="cap / balanced share")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    graphs: list[OpGraph] = []
    for size in args.sizes:
        for shape in args.shapes:
            layers = num_layers_for(size, SHAPES[shape])
            graphs.append(
                transformer_graph(
                    layers,
                    seed=args.seed,
                    shape=SHAPES[shape],
                    name=f"trn-{shape}_{layers}L",
                )
            )
        if args.layered:
            graphs.append(layered_graph(size, seed=args.seed))
    rows = []
    for graph in graphs:
        rows.append(run(graph, devices=args.devices, share=args.share))
        print(f"{graph.name}: done", file=sys.stderr, flush=True)
    table = Table(
        title=f"ParDNN, K={args.devices}, caps = {args.share:g} x balanced share of the "
        "single-device peak"
    )
    for col in (
        "graph",
        "V",
        "uncapped / single",
        "capped / single",
        "capped / uncapped",
        "uncapped peak / cap",
        "capped peak / cap",
        "uncapped s",
        "capped s (memory s)",
    ):
        table.add_column(col, justify="left" if col == "graph" else "right")
    for r in rows:
        table.add_row(
            r.graph,
            str(r.nodes),
            f"{r.uncapped_us / r.single_us:.4f}",
            f"{r.capped_us / r.single_us:.4f}",
            f"{r.ratio:.4f}",
            f"{r.uncapped_peak_over_cap:.3f}",
            f"{r.capped_peak_over_cap:.3f}",
            f"{r.uncapped_seconds:.2f}",
            f"{r.capped_seconds:.2f} ({r.memory_seconds:.2f})",
        )
    Console(width=160).print(table)
    summary = {
        "devices": args.devices,
        "cap_share": args.share,
        "capped_over_uncapped": {r.graph: round(r.ratio, 4) for r in rows},
        "uncapped_over_single": {r.graph: round(r.uncapped_us / r.single_us, 4) for r in rows},
        "capped_over_single": {r.graph: round(r.capped_us / r.single_us, 4) for r in rows},
        "caps_met": {r.graph: r.capped_peak_over_cap <= 1.0 for r in rows},
        "seconds": {
            r.graph: {
                "uncapped": round(r.uncapped_seconds, 2),
                "capped": round(r.capped_seconds, 2),
            }
            for r in rows
        },
        "geomean_capped_over_uncapped": round(
            math.exp(float(np.mean([math.log(r.ratio) for r in rows]))), 4
        )
        if rows
        else None,
    }
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
