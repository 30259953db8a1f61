"""`hspmd partition GRAPH --devices K`: place every op of a graph on K devices (ParDNN).

    hspmd partition graph.json --devices 4 --memory 16GiB --out placement.txt
    hspmd partition model.dot --devices 2 --memory 8GiB,12GiB --json
    hspmd partition graph.json --devices 4 --picture placement.png


GRAPH is a JSON graph (docs/partition.md) or the ParDNN authors' ``.dot`` with its side
files. The placement file has one ``op device`` line per op. ``--picture FILE.png|.svg``
draws the emulated schedule per device and memory over time against the caps. Sizes take B, KB, MB, GB,
TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024); bandwidth is in GB/s
(1 GB/s = 1000 bytes/us).
"""

from __future__ import annotations

import argparse
import json
import re
from typing import TYPE_CHECKING, Any

from hspmd.errors import PartitionError

if TYPE_CHECKING:
    from hspmd.partition.emulate import CommModel
    from hspmd.partition.graph import OpGraph
    from hspmd.partition.pardnn import PartitionResult

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes in ``16GiB``, ``500MB``, ``1.5GB`` or ``123456``.

    >>> parse_size("16GiB"), parse_size("500MB"), parse_size("42")
    (17179869184, 500000000, 42)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS:
        raise PartitionError(
            f"memory size {text!r} is not understood; write e.g. 16GiB, 500MB or 123456"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "partition",
        help="place an op graph on K devices (ParDNN): small makespan, memory caps met",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("graph", help="graph file: .json, or the authors' .dot + side files")
    parser.add_argument("--devices", type=int, required=True, help="number of devices K")
    parser.add_argument(
        "--memory", help="cap per device, e.g. 16GiB, or one per device: 8GiB,12GiB"
    )
    parser.add_argument("--latency-us", type=float, default=25.0, help="per transfer (25)")
    parser.add_argument(
        "--bandwidth-gbps", type=float, default=140.0, help="link bandwidth in GB/s (140)"
    )
    parser.add_argument("--out", help="placement file to write (one 'op device' line per op)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--picture", default=None, metavar="FILE",
        help="also draw FILE.png|.svg: schedule per device, memory over time against the caps",
    )  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hspmd.partition.emulate import CommModel
    from hspmd.partition.io import load_graph, write_placement
    from hspmd.partition.pardnn import partition

    if args.devices < 1:
        raise PartitionError(f"--devices {args.devices}: give at least 1 device")
    if args.picture:
        from hspmd.viz.common import check_picture_path

        check_picture_path(args.picture)  # before the work, not after
    caps: int | list[int] | None = None
    if args.memory:
        sizes = [parse_size(part) for part in args.memory.split(",")]
        if len(sizes) not in (1, args.devices):
            raise PartitionError(
                f"--memory has {len(sizes)} sizes for {args.devices} devices; give 1 or "
                f"{args.devices}"
            )
        caps = sizes[0] if len(sizes) == 1 else sizes
    comm = CommModel(latency_us=args.latency_us, bytes_per_us=args.bandwidth_gbps * 1000.0)
    graph = load_graph(args.graph)
    result = partition(graph, num_devices=args.devices, memory_bytes=caps, comm=comm)
    if args.out:
        write_placement(
            args.out,
            graph,
            result.placement,
            header=f"hspmd partition {graph.name}: K={args.devices}, {comm}\n{result.emulation}",
        )
    summary = _summary(graph, result, caps=caps, out=args.out, comm=comm)
    if args.picture:
        from hspmd.viz.partition import draw_partition

        draw_partition(
            graph, result.placement, result.emulation, args.picture,
            caps=summary["caps_bytes"],
            title=f"{graph.name}: {graph.num_nodes} ops on {args.devices} devices, makespan "
            f"{result.emulation.makespan_us / 1e3:,.3f} ms ({comm})",
        )  # fmt: skip
        summary["picture"] = args.picture
    if args.json:
        print(json.dumps(summary))
    else:
        _print_table(summary)
    return 0


def _summary(
    graph: OpGraph,
    result: PartitionResult,
    *,
    caps: int | list[int] | None,
    out: str | None,
    comm: CommModel,
) -> dict[str, Any]:
    import numpy as np

    from hspmd.partition import native

    k = len(result.emulation.peak_bytes)
    ops = np.bincount(result.placement, minlength=k)
    work = np.bincount(result.placement, weights=graph.time_us, minlength=k)
    cap_list = None if caps is None else np.broadcast_to(np.asarray(caps), (k,)).tolist()
    return {
        "graph": graph.name,
        "nodes": graph.num_nodes,
        "edges": graph.num_edges,
        "devices": k,
        "makespan_us": result.emulation.makespan_us,
        "single_device_makespan_us": float(graph.time_us.sum()),
        "peak_bytes": result.emulation.peak_bytes.tolist(),
        "caps_bytes": cap_list,
        "ops_per_device": ops.tolist(),
        "work_us_per_device": work.tolist(),
        "comm_bytes": result.emulation.comm_bytes,
        "comm_model": {"latency_us": comm.latency_us, "bytes_per_us": comm.bytes_per_us},
        "seconds": result.seconds,
        "phase_seconds": result.phase_seconds,
        "compiled_kernels": native.ENABLED,  # numba installed (partition/native.py)
        "placement_file": out,
    }


def _print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{summary['graph']}: {summary['nodes']} ops on {summary['devices']}")
    for column in ("device", "ops", "work ms", "peak GiB", "cap GiB"):
        table.add_column(column, justify="right")
    caps = summary["caps_bytes"] or [None] * summary["devices"]
    for d in range(summary["devices"]):
        table.add_row(
            str(d),
            str(summary["ops_per_device"][d]),
            f"{summary['work_us_per_device'][d] / 1e3:,.2f}",
            f"{summary['peak_bytes'][d] / 2**30:.3f}",
            "-" if caps[d] is None else f"{caps[d] / 2**30:.3f}",
        )
    console = Console()
    console.print(table)
    phases = ", ".join(f"{k} {v:.2f}s" for k, v in summary["phase_seconds"].items())
    single = summary["single_device_makespan_us"]
    speedup = single / summary["makespan_us"] if summary["makespan_us"] > 0 else 1.0
    console.print(
        f"makespan {summary['makespan_us'] / 1e3:,.3f} ms (one device: {single / 1e3:,.3f} ms, "
        f"{speedup:.2f}x); communication "
        f"{summary['comm_bytes'] / 2**30:.3f} GiB; partitioned in {summary['seconds']:.2f} s "
        f"({phases})"
        + (f"; placement -> {summary['placement_file']}" if summary["placement_file"] else "")
        + (f"; picture -> {summary['picture']}" if summary.get("picture") else "")
    )
