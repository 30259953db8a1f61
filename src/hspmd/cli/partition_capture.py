"""`hspmd partition-capture MODEL --out FILE`: one training step of a zoo model as a graph.

    hspmd partition-capture word_lstm-large --out word_lstm-large.json
    hspmd partition-capture word_lstm-tiny --measure --out tiny.json   # CPU op times
    hspmd partition-capture word_lstm-tiny --measure --repeats 9 --out tiny.json
    hspmd partition-capture --list

The graph is written in the JSON schema that ``hspmd partition`` reads; its ``meta``
says whether the op times are measured (``--measure``: the median of ``--repeats`` timed
runs of the step on real tensors) or a roofline of ``--device``. Without ``--measure``
capture runs on meta tensors, so even the large presets allocate nothing.
"""

from __future__ import annotations

import argparse
import time

from hspmd.cli.paths import check_out_folder
from hspmd.errors import PartitionError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "partition-capture",
        help="capture a zoo model's training step as an op graph (JSON)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", nargs="?", help="preset, e.g. word_lstm-large (see --list)")
    parser.add_argument("--out", help="graph JSON to write")
    parser.add_argument("--device", default="v100", help="roofline device (v100, a100, h100)")
    parser.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    parser.add_argument(
        "--measure", action="store_true", help="time each op on this CPU (small presets only)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs of the step with --measure (median)"
    )
    parser.add_argument("--list", action="store_true", help="list the presets and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hspmd.partition.capture import DEVICES
    from hspmd.partition.io import save_graph_json
    from hspmd.partition.zoo import PRESETS, capture_preset

    if args.list:
        for name, preset in PRESETS.items():
            print(f"{name:20s} {preset.family:12s} {preset.config}")
        return 0
    if not args.model or not args.out:
        raise PartitionError("give a MODEL preset and --out FILE (or --list)")
    if args.device not in DEVICES:
        raise PartitionError(
            f"device {args.device!r} is not known; choose one of {sorted(DEVICES)}"
        )
    if args.repeats < 1:
        raise PartitionError(f"--repeats {args.repeats} must be >= 1")
    check_out_folder(args.out, "--out")  # before the capture, which takes a while
    start = time.perf_counter()
    graph = capture_preset(
        args.model,
        device=DEVICES[args.device],
        optimizer=args.optimizer,
        measure=args.measure,
        repeats=args.repeats,
    )
    save_graph_json(args.out, graph)
    source = (
        f"median of {args.repeats} timed runs on this CPU"
        if args.measure
        else f"roofline of {args.device}"
    )
    print(
        f"{graph.name}: {graph.num_nodes} ops, {graph.num_edges} edges, "
        f"{graph.time_us.sum() / 1e3:,.1f} ms of work "
        f"({source}), "
        f"{graph.residual_bytes.sum() / 2**30:.2f} GiB residual; "
        f"captured in {time.perf_counter() - start:.1f} s -> {args.out}"
    )
    return 0
