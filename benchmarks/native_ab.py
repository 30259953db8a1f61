"""The partitioner's event-loop kernels of two ``native.py`` files, side by side.

For an edit of ``hspmd/partition/native.py``: loads this tree's file and a baseline copy
(``--baseline``, e.g. ``git show HEAD~1:src/hspmd/partition/native.py > /tmp/old.py``)
as two modules, runs ``schedule_kernel``, ``eft_kernel`` and ``relieve_round_kernel`` of
each on the same inputs from one generated layered graph (K=4), alternated,
``--repeats`` times, checks that their outputs are identical, and prints the process
CPU time of each (min and median, table, then one JSON line). CPU time, not wall time:
on a shared, loaded machine the wall time of a 50 ms call swings several-fold, the CPU
time by a few percent. The first run after an edit compiles the kernels (seconds,
untimed: one warm-up call each).

    .venv/bin/python benchmarks/native_ab.py --baseline /tmp/old.py               # 200K ops
    .venv/bin/python benchmarks/native_ab.py --baseline /tmp/old.py --size 50000 --repeats 21

Needs numba (without it both files hold plain Python loops and the comparison says little).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from hspmd.partition import native, refine
from hspmd.partition.emulate import CommModel
from hspmd.partition.generate import layered_graph
from hspmd.partition.graph import OpGraph, longest_paths
from hspmd.partition.mapping import boundary_lists
from hspmd.partition.pardnn import partition
from hspmd.partition.slicing import slice_graph

K = 4
Kernel = Callable[[ModuleType], Any]


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernels(graph: OpGraph) -> dict[str, Kernel]:
    """Each kernel as a call on fixed inputs (mutated inputs copied per call)."""
    comm = CommModel()
    place = partition(graph, num_devices=K).placement.astype(np.int64)
    delay = comm.cost_us(graph.out_bytes).astype(np.float64)
    rank = np.ascontiguousarray(graph.topo_rank, dtype=np.float64)
    g = graph
    schedule_args = (place, g.time_us, delay, g.topo_rank, g.out_ptr, g.dst, g.in_degree, K)
    eft_args = (
        K, np.full(g.num_nodes, -1, np.int64), g.group_of, g.out_ptr, g.dst, g.in_ptr,
        g.preds, g.time_us, delay, rank, g.in_degree,
    )  # fmt: skip
    # load relief from a lopsided start: every secondary cluster on device 0
    edge_us = comm.cost_us(g.out_bytes[g.src])
    slicing = slice_graph(g, num_devices=K, edge_us=edge_us)
    boundary = boundary_lists(g, slicing, edge_us=edge_us)
    arrays = refine._Relief(g, slicing, edge_us=edge_us, boundary=boundary)._kernel_arrays()
    primary = slicing.cluster_of < slicing.num_primary
    start = np.where(primary, np.minimum(slicing.cluster_of, K - 1), 0).astype(np.int64)
    start = start[g.group_of]
    crossing = np.where(start[g.src] != start[g.dst], edge_us, 0.0)
    top, bottom = longest_paths(g, node_w=g.time_us, edge_w=crossing)
    limit = float((top + bottom).max(initial=0.0)) + 1e-9

    def relieve(m: ModuleType) -> tuple[np.ndarray, int]:
        moved_place = start.copy()
        load = np.bincount(moved_place, weights=g.time_us, minlength=K)
        o, members, ptr, free, work, cl, b_ptr, b_other, b_cost, side = arrays
        moved = m.relieve_round_kernel(
            o, members, ptr, moved_place, free, work, load, cl, b_ptr, b_other, b_cost, side,
            top, bottom, g.time_us, limit,
        )  # fmt: skip
        return moved_place, int(moved)

    return {
        "schedule_kernel": lambda m: m.schedule_kernel(*schedule_args),
        "eft_kernel": lambda m: m.eft_kernel(*eft_args),
        "relieve_round_kernel": relieve,
    }


def _same(a: Any, b: Any) -> bool:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _compare(kernel: Kernel, modules: dict[str, ModuleType], repeats: int) -> dict[str, Any]:
    same = _same(kernel(modules["baseline"]), kernel(modules["tree"]))  # also the warm-up
    seconds: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(repeats):
        for name, module in modules.items():
            begin = time.process_time()
            kernel(module)
            seconds[name].append(time.process_time() - begin)
    row: dict[str, Any] = {"identical": same}
    for name, values in seconds.items():
        row[f"{name}_min_ms"] = round(1e3 * min(values), 2)
        row[f"{name}_median_ms"] = round(1e3 * statistics.median(values), 2)
    row["tree_over_baseline_min"] = round(min(seconds["tree"]) / min(seconds["baseline"]), 3)
    row["tree_over_baseline_median"] = round(
        statistics.median(seconds["tree"]) / statistics.median(seconds["baseline"]), 3
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the other native.py")
    parser.add_argument("--size", type=int, default=200000, help="op count (200000)")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per file (15)")
    args = parser.parse_args(argv)
    if not args.baseline.is_file():
        print(
            f"--baseline {args.baseline}: no such file; give a copy of native.py", file=sys.stderr
        )
        return 2
    modules = {
        "baseline": _load(args.baseline, "native_baseline"),
        "tree": _load(Path(native.__file__), "native_tree"),
    }
    kernels = _kernels(layered_graph(args.size, seed=0))
    rows = {name: _compare(kernel, modules, args.repeats) for name, kernel in kernels.items()}
    table = Table(title=f"kernel CPU time (ms), {args.size} ops, K={K}, {args.repeats} calls each")
    for column in ("kernel", "identical", "baseline min", "tree min", "baseline med", "tree med"):
        table.add_column(column, justify="left" if column == "kernel" else "right")
    table.add_column("tree/baseline (med)", justify="right")
    for name, r in rows.items():
        table.add_row(
            name, str(r["identical"]), f"{r['baseline_min_ms']:.2f}", f"{r['tree_min_ms']:.2f}",
            f"{r['baseline_median_ms']:.2f}", f"{r['tree_median_ms']:.2f}",
            f"{r['tree_over_baseline_median']:.3f}",
        )  # fmt: skip
    Console(width=150).print(table)
    print(json.dumps({"numba": native.ENABLED, "size": args.size, "kernels": rows}))
    return 0 if all(r["identical"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
