"""`hspmd reshard`: resolve one reshard and print its per-rank plan.

    hspmd reshard --src "[0,1,2,3]{P:2,0:2}" --dst "h0: [0,1]{D:2} [2,3]{1:2}" --shape 8,12
    hspmd reshard ... --json                  # the same plan as JSON
    hspmd reshard ... --simulate --dump DIR   # run it in the simulator on arange(prod(shape))
    hspmd reshard ... --nproc 4 --dump DIR    # run it on 4 local processes (gloo)

``--simulate`` and ``--nproc`` are refused together; the output says which one ran.

``--dump`` writes ``DIR/rank<R>.npy`` for every destination rank: its local tensor of the
float64 global tensor ``arange(prod(shape)).reshape(shape)``; partial sources start with the
first summand holding everything.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from hspmd.annotation import Annotation, parse_annotation
from hspmd.comm.plan import BatchedSendRecv, CommPlan, region_text
from hspmd.comm.resolve import resolve
from hspmd.comm.simulate import scatter, simulate
from hspmd.errors import HspmdError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "reshard",
        help="resolve a reshard between two annotations and print the per-rank plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--src", required=True, help='source annotation, e.g. "[0,1]{0:2}"')
    parser.add_argument("--dst", required=True, help='destination, e.g. "h0: [0]{} [1]{}"')
    parser.add_argument("--shape", required=True, help="global shape, e.g. 8,12")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--simulate", action="store_true", help="run the plan in the simulator")
    parser.add_argument("--dump", metavar="DIR", help="write DIR/rank<R>.npy per dst rank")
    parser.add_argument("--nproc", type=int, help="run the plan on N local processes")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.set_defaults(func=run)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,12"`` -> ``(8, 12)``."""
    try:
        shape = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        shape = ()
    if not shape or any(n <= 0 for n in shape):
        raise HspmdError(f"bad --shape {text!r}: expected positive integers like 8,12")
    return shape


def run(args: argparse.Namespace) -> int:
    shape = parse_shape(args.shape)
    if args.simulate and args.nproc:
        raise HspmdError(
            f"--simulate and --nproc {args.nproc} both run the plan: give --simulate for the "
            "numpy simulator or --nproc N for N local processes, not both"
        )
    plan = resolve(parse_annotation(args.src), parse_annotation(args.dst), shape)
    print(json.dumps(plan_json(plan)) if args.json else plan_text(plan))
    if not (args.simulate or args.nproc or args.dump):
        return 0
    value = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    if args.nproc:
        out = _run_processes(plan, nproc=args.nproc, backend=args.backend, value=value)
        ran = f"ran on {args.nproc} local processes ({args.backend})"
    else:
        out = simulate(plan, scatter(plan.src, value))
        ran = "ran in the numpy simulator"
    if not args.json:
        print(ran)
    if args.dump:
        folder = Path(args.dump)
        folder.mkdir(parents=True, exist_ok=True)
        for rank, tensor in sorted(out.items()):
            np.save(folder / f"rank{rank}.npy", tensor)
        if not args.json:
            print(f"wrote {len(out)} files to {folder}/rank<R>.npy")
    elif not args.json:
        for rank, tensor in sorted(out.items()):
            print(f"rank {rank}: shape {list(tensor.shape)} sum {tensor.sum():g}")
    return 0


def plan_json(plan: CommPlan) -> dict[str, Any]:
    """``plan.to_json()`` plus ``per_rank``: each rank's pieces and steps, as in the text."""
    per_rank = {}
    for rank in plan.ranks:
        per_rank[str(rank)] = {
            "src": _region_of(plan.src, rank, plan.shape),
            "dst": _region_of(plan.dst, rank, plan.shape),
            "steps": [
                {"index": i, "kind": step.kind, "text": step.describe(rank)}
                for i, step in plan.for_rank(rank)
            ],
        }
    return {**plan.to_json(), "kinds": list(plan.kinds), "per_rank": per_rank}


def _region_of(annotation: Annotation, rank: int, shape: tuple[int, ...]) -> list | None:
    if rank not in annotation:
        return None
    return [list(span) for span in annotation.piece(rank, shape).region]


def plan_text(plan: CommPlan) -> str:
    """``str(plan)`` with the slices of every BSR step under the ranks that move them."""
    lines = [f"reshard {plan.src} -> {plan.dst} shape={list(plan.shape)}"]
    if not plan.steps:
        lines.append("  identity")
    for rank in plan.ranks:
        src = region_text(plan.src.piece(rank, plan.shape).region) if rank in plan.src else "-"
        dst = region_text(plan.dst.piece(rank, plan.shape).region) if rank in plan.dst else "-"
        lines.append(f"  rank {rank}: {src} -> {dst}")
        for index, step in plan.for_rank(rank):
            lines.append(f"    {index}: {step.describe(rank)}")
            if isinstance(step, BatchedSendRecv):
                lines.extend(_bsr_lines(step, rank))
    return "\n".join(lines)


def _bsr_lines(step: BatchedSendRecv, rank: int) -> list[str]:
    out = []
    for t in step.transfers:
        if t.src == t.dst == rank:
            out.append(f"       copy {region_text(t.region)}")
        elif t.src == rank:
            out.append(f"       send {region_text(t.region)} to {t.dst}")
        elif t.dst == rank:
            out.append(f"       recv {region_text(t.region)} from {t.src}")
    return out


def _run_processes(
    plan: CommPlan, *, nproc: int, backend: str, value: np.ndarray
) -> dict[int, np.ndarray]:
    try:
        module = importlib.import_module("hspmd.runtime.plan_runs")
    except ImportError as error:
        raise HspmdError(
            f"--nproc needs hspmd.runtime.plan_runs, which cannot be imported ({error}): "
            "use --simulate instead"
        ) from error
    result: dict[int, np.ndarray] = module.run_plan_processes(
        plan, nproc=nproc, backend=backend, value=value
    )
    return result
