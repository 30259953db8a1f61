"""`hspmd timeline TRACE.json --out FILE.png`, and `hspmd train --trace / --timeline /
--predict`: the flags' checks and their files.

The checks run before any process starts (a wrong suffix or a missing folder costs no
training); the files are written from the run's merged trace (``hspmd.runtime.trace``)::

    hspmd train ... --trace run.json                  # chrome://tracing or ui.perfetto.dev
    hspmd train ... --timeline run.png                # every step, rows = ranks
    hspmd train ... --timeline last.png --predict     # the last step over its prediction
    hspmd timeline run.json --out step7.svg --step 7  # later, from the file: one step
    hspmd timeline step.json --out step.png           # or a `hspmd simulate --trace` file
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hspmd.train.config import TrainConfig, TrainError
from hspmd.train.reference import TrainResult
from hspmd.viz.common import check_picture_path

if TYPE_CHECKING:
    from hspmd.planner.predict import Prediction

__all__ = ["check_trace_flags", "register", "write_outputs"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "timeline",
        help="draw a trace of hspmd train or hspmd simulate as a Gantt chart",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("trace", metavar="TRACE.json", help="a --trace file")
    parser.add_argument("--out", required=True, metavar="FILE", help="the picture (.png/.svg)")
    parser.add_argument(
        "--step", type=int, default=None, help="only this step (a train trace), from 0 s"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hspmd.viz.timeline import bars_from_trace, draw_timeline, one_step

    check_picture_path(args.out, flag="--out")
    trace = _read_trace(args.trace)
    bars = bars_from_trace(trace)
    if args.step is not None:
        bars = one_step(bars, step=args.step)
    other = trace.get("otherData", {})
    title = " ".join(str(other[k]) for k in ("model", "strategy") if other.get(k))
    if args.step is not None:
        title += f" (step {args.step})"
    draw_timeline(bars, args.out, title=title or Path(args.trace).name)
    ranks = len({b.rank for b in bars})
    print(f"{len(bars)} spans of {ranks} ranks -> {args.out}", file=sys.stderr)
    return 0


def _read_trace(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TrainError(f"{path!r}: no such file; write one with hspmd train --trace") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TrainError(f"{path!r} is not JSON ({error}): pass a --trace file") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TrainError(
            f"{path!r} has no traceEvents list: pass a file of hspmd train/simulate --trace"
        )
    return data


def check_trace_flags(args: argparse.Namespace) -> bool:
    """Whether the run must be traced; TrainError / PictureError naming the flag to fix."""
    trace, timeline = getattr(args, "trace", None), getattr(args, "timeline", None)
    predict, profile = getattr(args, "predict", False), getattr(args, "predict_profile", None)
    if predict and not timeline:
        raise TrainError("--predict draws over the measured timeline: add --timeline FILE.png")
    if profile and not predict:
        raise TrainError("--predict-profile is read by --predict: add --predict --timeline FILE")
    if profile and not Path(profile).is_file():
        raise TrainError(
            f"--predict-profile {profile!r}: no such file; write one with hspmd profile"
        )
    if (trace or timeline) and args.reference:
        raise TrainError(
            "--reference runs the plain model on this process, which is not traced: drop "
            "--trace/--timeline, or --reference"
        )
    if trace:
        out = Path(trace)
        if out.suffix.lower() != ".json":
            raise TrainError(f"--trace {trace!r}: traces are JSON files: name it {out.stem}.json")
        if not out.parent.is_dir():
            raise TrainError(f"--trace {trace!r}: folder {str(out.parent)!r} does not exist")
    if timeline:
        check_picture_path(timeline, flag="--timeline")
    return bool(trace or timeline)


def write_outputs(args: argparse.Namespace, config: TrainConfig, result: TrainResult) -> None:
    """Write ``--trace`` and ``--timeline`` from ``result.trace``; one line each on stderr."""
    trace = result.trace
    assert trace is not None, "a traced run carries its trace"
    ranks = len({e["pid"] for e in trace["traceEvents"]})
    if args.trace:
        Path(args.trace).write_text(json.dumps(trace))
        spans = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
        print(f"trace of {ranks} ranks, {spans} spans -> {args.trace} "
              "(open in ui.perfetto.dev or chrome://tracing)", file=sys.stderr)  # fmt: skip
    if not args.timeline:
        return
    from hspmd.viz.timeline import bars_from_result, bars_from_trace, draw_timeline, one_step

    bars = bars_from_trace(trace)
    title = f"{config.model.source}, {ranks} ranks: {config.strategy_at(config.steps)}"
    if not args.predict:
        draw_timeline(bars, args.timeline, title=title)
        print(f"timeline of {config.steps} steps -> {args.timeline}", file=sys.stderr)
        return
    measured = one_step(bars)
    prediction = _predict(config, profile=args.predict_profile)
    took = max(b.end for b in measured if b.kind == "step")
    title = (
        f"{title}\nstep {config.steps}: measured {took * 1e3:.1f} ms, predicted "
        f"{prediction.step_time_s * 1e3:.1f} ms (hspmd.planner.local cost model)"
    )
    draw_timeline(measured, args.timeline, predicted=bars_from_result(prediction.result),
                  title=title)  # fmt: skip
    print(
        f"timeline of step {config.steps}: measured {took * 1e3:.1f} ms over predicted "
        f"{prediction.step_time_s * 1e3:.1f} ms -> {args.timeline}",
        file=sys.stderr,
    )


def _predict(config: TrainConfig, *, profile: str | None) -> Prediction:
    """The simulator's step of the run's last strategy on local processes."""
    from hspmd.cost.captured import planning_model
    from hspmd.planner.local import local_cost
    from hspmd.planner.predict import predict

    strategy = config.strategy_at(config.steps)
    cost = local_cost(
        1 + max(strategy.ranks), ranks_per_node=config.switching.ranks_per_node, profile=profile,
        dtype="bf16" if config.options.dtype == "bf16" else "fp32",
    )  # fmt: skip
    return predict(
        strategy,
        planning_model(config.model_config()),
        cost,
        seq_len=config.batch.seq_len,
        options=config.options,
    )
