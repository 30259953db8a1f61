"""Partitioning time of generated graphs: compiled kernels against the pure-Python loops.

``hspmd.partition.native`` compiles the partitioner's hottest loops with numba when it
is installed. This runs, on one generated layered graph per size (K=4), the whole
``hspmd partition`` path (load the graph from its JSON file, partition, emulate) with
the kernels and with the pure-Python loops, alternated, ``--repeats`` times each, checks
that both give the same placement, and prints the medians side by side (table, then one
JSON line), with the machine's load average before and after. Seconds are wall time;
``cpu`` is the process CPU time of the partition call (less sensitive to a loaded
machine, though shared cores slow it too).

    .venv/bin/python benchmarks/partition_speed.py                    # 200K ops, 3 repeats
    .venv/bin/python benchmarks/partition_speed.py --sizes 50000 200000 --repeats 5

Without numba only the Python column is measured. The first run after an edit of
``native.py`` compiles the kernels (seconds); one untimed warm-up run absorbs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from hspmd.partition import native
from hspmd.partition.generate import layered_graph
from hspmd.partition.io import load_graph, save_graph_json
from hspmd.partition.pardnn import partition

PHASES = ("load", "slicing", "mapping", "refinement", "eft", "emulation")


def _once(path: Path, k: int, *, compiled: bool) -> tuple[dict[str, float], np.ndarray, float]:
    native.ENABLED = compiled
    start = time.perf_counter()
    graph = load_graph(path)
    loaded = time.perf_counter() - start
    cpu = time.process_time()
    result = partition(graph, num_devices=k)
    cpu = time.process_time() - cpu  # on a loaded machine: what the call itself needed
    phases = {"load": loaded, **result.phase_seconds, "partition": result.seconds, "cpu": cpu}
    return phases, result.placement, result.emulation.makespan_us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", type=int, default=[200000], help="op counts")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode (3)")
    parser.add_argument("--devices", type=int, default=4, help="K (4)")
    args = parser.parse_args(argv)
    have_kernels = native.ENABLED
    modes = [True, False] if have_kernels else [False]
    load_before = os.getloadavg()
    rows: dict[str, dict[str, object]] = {}
    console = Console(width=150)
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            path = Path(tmp) / f"layered_{size}.json"
            save_graph_json(path, layered_graph(size, seed=0))
            if have_kernels:
                _once(path, args.devices, compiled=True)  # warm-up: load or compile kernels
            runs: dict[bool, list[dict[str, float]]] = {m: [] for m in modes}
            placements: dict[bool, np.ndarray] = {}
            makespans: dict[bool, float] = {}
            for _ in range(args.repeats):
                for mode in modes:
                    phases, place, makespan = _once(path, args.devices, compiled=mode)
                    runs[mode].append(phases)
                    placements[mode], makespans[mode] = place, makespan
            native.ENABLED = have_kernels
            row: dict[str, object] = {"nodes": size, "makespan_us": makespans[modes[0]]}
            for mode in modes:
                name = "compiled" if mode else "python"
                row[name] = {
                    p: round(statistics.median(r[p] for r in runs[mode]), 3)
                    for p in (*PHASES, "partition", "cpu")
                }
                row[f"{name}_partition_runs"] = [round(r["partition"], 3) for r in runs[mode]]
            if have_kernels:
                row["same_placement"] = bool(np.array_equal(placements[True], placements[False]))
                c, p = row["compiled"], row["python"]
                assert isinstance(c, dict) and isinstance(p, dict)
                row["partition_compiled_over_python"] = round(c["partition"] / p["partition"], 3)
                row["cpu_compiled_over_python"] = round(c["cpu"] / p["cpu"], 3)
                row["load_and_partition_compiled_over_python"] = round(
                    (c["partition"] + c["load"]) / (p["partition"] + p["load"]), 3
                )
            rows[f"layered_{size}"] = row
    load_after = os.getloadavg()
    table = Table(title=f"partition time, median of {args.repeats} (s), K={args.devices}")
    table.add_column("graph")
    table.add_column("mode")
    for p in (*PHASES, "partition", "cpu"):
        table.add_column(p, justify="right")
    for name, row in rows.items():
        for mode in ("compiled", "python"):
            if mode in row:
                cells = row[mode]
                assert isinstance(cells, dict)
                table.add_row(
                    name, mode, *(f"{cells[p]:.2f}" for p in (*PHASES, "partition", "cpu"))
                )
    console.print(table)
    summary = {
        "kernels": "numba " + _numba_version() if have_kernels else "none (pure Python)",
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "graphs": rows,
    }
    print(json.dumps(summary))
    return 0 if all(r.get("same_placement", True) for r in rows.values()) else 1


def _numba_version() -> str:
    import numba  # type: ignore[import-not-found,unused-ignore]

    return str(numba.__version__)


if __name__ == "__main__":
    sys.exit(main())
