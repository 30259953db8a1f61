"""The timeline of a run as a Gantt chart: measured (a trace), predicted (the simulator),
or both overlaid.

Both sources become ``Bar``s: one per span, on a rank's ``compute`` or ``comm`` lane, with
a ``kind`` that picks the colour and a ``depth`` (spans nest: Post holds its grad sync)::

    bars = bars_from_trace(result.trace)             # hspmd train --trace's JSON
    draw_timeline(bars, "run.png")                    # rows = ranks
    predicted = bars_from_result(prediction.result)   # hspmd.planner.predict
    draw_timeline(one_step(bars), "vs.png", predicted=predicted)

Kinds: ``forward`` ``backward`` (F, B of a micro-batch), ``post`` (gradient sync and the
optimizer, with ``sync`` nested inside it), ``comm`` (one communication step), ``wait``
(waiting for a step in flight), ``switch``, ``checkpoint``, ``setup``; the simulator's
``optimizer``. A measured step's span is not drawn as a bar: its start is a dotted line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hspmd.sim.engine import Result
from hspmd.viz.common import PictureError, check_picture_path, new_figure, save

__all__ = [
    "Bar",
    "bars_from_result",
    "bars_from_trace",
    "draw_timeline",
    "one_step",
    "step_marks",
]

COMPUTE_LANE, COMM_LANE = 0, 1
KIND_COLOURS = {
    "forward": "#0173b2",
    "backward": "#de8f05",
    "post": "#029e73",
    "optimizer": "#029e73",
    "sync": "#56b4e9",
    "comm": "#d55e00",
    "wait": "#cfcfcf",
    "switch": "#cc78bc",
    "checkpoint": "#ca9161",
    "setup": "#949494",
}
_OTHER = "#ece133"
_LABELLED = ("forward", "backward")
_SIM_KINDS = {"F": "forward", "B": "backward"}  # the simulator's compute categories
_MAX_STEP_MARKS = 25
_MAX_HEIGHT_IN = 40.0  # past ~90 rows the rows get thinner, not the page longer


@dataclass(frozen=True, slots=True)
class Bar:
    """One span on one rank's lane, times in seconds."""

    rank: int
    lane: int  # COMPUTE_LANE or COMM_LANE
    start: float
    end: float
    kind: str
    label: str = ""
    depth: int = 0  # nesting on its lane, outermost 0
    step: int | None = None  # a measured step's number: drawn as a line, not a bar


def bars_from_trace(trace: dict[str, Any]) -> list[Bar]:
    """The ``X`` events of a ``hspmd train --trace`` file (``hspmd.runtime.trace``), or of
    ``hspmd simulate --trace`` (``hspmd.sim.trace``: categories ``F``/``B`` become
    forward/backward); a thread named ``compute`` is the compute lane, any other the comm
    lane."""
    every = trace.get("traceEvents", [])
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in every
               if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip
    events = sorted(
        (e for e in every if e.get("ph") == "X"),
        key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]),
    )
    bars: list[Bar] = []
    ends: dict[tuple[int, int], list[float]] = {}
    for e in events:
        start, end = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        stack = ends.setdefault((e["pid"], e["tid"]), [])
        while stack and stack[-1] <= start:
            stack.pop()
        args = e.get("args") or {}
        kind = _SIM_KINDS.get(e.get("cat", ""), e.get("cat", ""))
        if kind == "step":  # a frame, not a bar: it does not push the depth of its spans
            bars.append(
                Bar(e["pid"], COMPUTE_LANE, start, end, kind, e["name"], 0, args.get("step"))
            )
            continue
        label = e["name"]
        if kind in _LABELLED and "micro_batch" in args:
            label = f"{e['name']}{args['micro_batch']}"
        thread = threads.get((e["pid"], e["tid"]), "compute" if e["tid"] == 0 else "comm")
        lane = COMPUTE_LANE if thread == "compute" else COMM_LANE
        bars.append(Bar(e["pid"], lane, start, end, kind, label, len(stack)))
        stack.append(end)
    return bars


def bars_from_result(result: Result) -> list[Bar]:
    """A simulated step (``hspmd.sim``): compute streams on the compute lane, the rest on
    the comm lane; categories ``F``/``B`` become forward/backward; a collective gives one
    bar on each participant."""
    bars = []
    for s in result.spans:
        lane = COMPUTE_LANE if s.stream == "compute" else COMM_LANE
        kind = _SIM_KINDS.get(s.category, s.category)
        for rank in s.ranks:
            bars.append(Bar(rank, lane, s.start, s.end, kind, s.label or s.task_id))
    return bars


def one_step(bars: Sequence[Bar], *, step: int | None = None) -> list[Bar]:
    """The bars of one measured step (default: the last), shifted to start at 0 s; a bar
    is kept where it starts inside the step on its rank."""
    frames = [b for b in bars if b.kind == "step"]
    if not frames:
        raise PictureError("the trace has no step spans: trace a run of hspmd train")
    numbers = sorted({b.step for b in frames if b.step is not None})
    chosen = numbers[-1] if step is None else step
    if chosen not in numbers:
        raise PictureError(f"step {step} is not in the trace (it has steps {numbers})")
    window = {b.rank: (b.start, b.end) for b in frames if b.step == chosen}
    origin = min(begin for begin, _ in window.values())
    out = []
    for b in bars:
        if b.rank in window and window[b.rank][0] <= b.start < window[b.rank][1]:
            out.append(replace(b, start=b.start - origin, end=b.end - origin))
    return out


def step_marks(bars: Sequence[Bar]) -> list[Bar]:
    """The step frames to mark with a line: all of them up to 25, else every k-th.

    >>> frames = [Bar(0, 0, s, s + 1, "step", f"step {s}", step=s) for s in range(1, 101)]
    >>> [b.step for b in step_marks(frames)][:3], len(step_marks(frames))
    ([1, 5, 9], 25)
    """
    frames = sorted((b for b in bars if b.kind == "step"), key=lambda b: b.start)
    every = max(1, -(-len(frames) // _MAX_STEP_MARKS))
    return frames[::every]


def draw_timeline(
    bars: Sequence[Bar], path: str | Path, *, predicted: Sequence[Bar] | None = None,
    title: str = "", skip_setup: bool = True,
) -> Path:  # fmt: skip
    """Rows = ranks (a compute lane over a comm lane), colours by kind; with ``predicted``
    each rank gets a second, hatched row of the prediction under its measured one.
    ``skip_setup``: the time axis starts after the setup span (building the executables)."""
    check_picture_path(path, flag="--timeline")
    shown = [b for b in bars if not (skip_setup and b.kind == "setup")]
    if not shown and not predicted:
        raise PictureError("nothing to draw: the trace has no spans")
    origin = min((b.start for b in shown), default=0.0)
    shown = [replace(b, start=b.start - origin, end=b.end - origin) for b in shown]
    sources = [("measured" if predicted else "", shown, False)]
    if predicted:
        sources.append(("predicted", list(predicted), True))
    ranks = sorted({b.rank for _, src, _ in sources for b in src})
    rows = [(rank, name, src, hatched) for rank in ranks for name, src, hatched in sources]
    fig = new_figure(width=12.0, height=min(1.2 + 0.45 * len(rows), _MAX_HEIGHT_IN))
    ax = fig.add_subplot()
    seen: dict[str, str] = {}
    for row, (rank, _, src, hatched) in enumerate(rows):
        _draw_row(ax, [b for b in src if b.rank == rank], row, hatched=hatched, seen=seen)
    end = max((b.end for _, src, _ in sources for b in src), default=1.0) or 1.0
    _labels(ax, rows, end)
    for b in step_marks([b for b in shown if b.rank == ranks[0]]):
        ax.axvline(b.start, color="#555555", linestyle=":", linewidth=0.8)
        ax.text(b.start, -0.55, f" {b.label}", fontsize=7, va="bottom", color="#555555")
    ax.set_yticks(range(len(rows)), [f"rank {r} {name}".strip() for r, name, _, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.75)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=9)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, label=k) for k, c in seen.items()]
    if predicted:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="predicted"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    return save(fig, path)


def _draw_row(
    ax: Any, bars: Iterable[Bar], row: int, *, hatched: bool, seen: dict[str, str]
) -> None:
    """Compute lane in the upper part of the row, comm lane in the lower; nested spans
    drawn over their parents, thinner."""
    groups: dict[tuple[int, int, str], list[tuple[float, float]]] = {}
    for b in bars:
        if b.kind == "step":
            continue
        groups.setdefault((b.lane, b.depth, b.kind), []).append((b.start, b.end - b.start))
    for (lane, depth, kind), xs in sorted(groups.items()):
        colour = seen.setdefault(kind, KIND_COLOURS.get(kind, _OTHER))
        top, height = (row - 0.42, 0.5) if lane == COMPUTE_LANE else (row + 0.12, 0.3)
        shrink = height * (1 - 0.7**depth) / 2
        ax.broken_barh(
            xs, (top + shrink, height - 2 * shrink), facecolors=colour,
            edgecolor="black" if hatched else "white", linewidth=0.2,
            hatch="///" if hatched else None, alpha=0.75 if hatched else 1.0,
        )  # fmt: skip


def _labels(ax: Any, rows: Sequence[tuple[int, str, Sequence[Bar], bool]], end: float) -> None:
    """F/B labels inside bars wide enough for them (at most a few hundred)."""
    points = 12.0 * 72 * 0.75 / end  # points per second, roughly
    placed = 0
    for row, (rank, _, src, _) in enumerate(rows):
        for b in src:
            if b.rank != rank or b.kind not in _LABELLED:
                continue
            if (b.end - b.start) * points < 5.0 * len(b.label) + 4 or placed > 400:
                continue
            ax.text((b.start + b.end) / 2, row - 0.17, b.label, ha="center", va="center",
                    fontsize=6, color="white")  # fmt: skip
            placed += 1
